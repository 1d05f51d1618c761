"""The reader of a staged-file store: applies committed versions, in order, onto a receiver.

Only versions whose manifest is committed exist. The reader takes the current chain
(the latest full version and the deltas after it): when its receiver holds a version of
that chain it applies the versions after it; otherwise (no version yet, another stream,
or a base that an anchor pruned) it re-seeds from the chain's full version. Every file
is checked against the manifest's size and xxh3-128 before use. Payloads go through
``Receiver.receive`` (a full version as ``encode_full`` of its checkpoint), so stream
and version checks live in one place.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import safetensors.torch
from dte_codec import digests, encode_full

from .durable import read_verified
from .errors import CorruptFileError, ManifestError, RejectedVersionError, WeightDigestError
from .manifest import Manifest, committed, current_chain
from .receiver import Receiver
from .staged import PAYLOAD_TENSOR

log = logging.getLogger(__name__)

ATTEMPTS = 3
"""Re-reads of the store within one poll when the writer prunes the versions being read."""


class _Pruned(Exception):
    """A manifest, or a file together with its manifest, disappeared while being read."""


class StagedReader:
    """Moves a ``Receiver`` forward along the committed versions of a staged-file store.

    Args:
        root: the store's directory.
        receiver: the live tensors to update.
        verify_weights: after each version, compare every tensor's digest with the
            manifest (reads the whole model once per version).
    """

    def __init__(self, root: str | os.PathLike, receiver: Receiver, *,
                 verify_weights: bool = False):
        self.root = Path(root)
        self.receiver = receiver
        self.verify_weights = verify_weights

    def poll(self) -> list[int]:
        """Apply every committed version the receiver does not hold yet, in order.

        Returns:
            The versions applied, in order (empty when the receiver is up to date).

        Raises:
            CorruptFileError: a file differs from its manifest; the receiver stays at the
                last version applied before it.
            RejectedVersionError: the receiver refused a version; likewise.
            WeightDigestError: a tensor's digest after a version differs from the
                manifest's (``verify_weights`` only); the receiver then holds no version.
            ManifestError: a manifest is unreadable or inconsistent.
        """
        applied: list[int] = []
        for _ in range(ATTEMPTS):
            try:
                for manifest in self._pending():
                    self._apply(manifest)
                    applied.append(manifest.version)
                if applied:
                    log.info("applied v%s from %s", ", v".join(map(str, applied)), self.root)
                return applied
            except _Pruned:
                log.debug("a newer full version pruned the one being read; reading again")
        log.warning("staged store %s: pruned while reading %d times in a row; applied %s",
                    self.root, ATTEMPTS, applied)
        return applied

    def _pending(self) -> list[Manifest]:
        try:
            chain = current_chain(committed(self.root))
        except FileNotFoundError as exc:
            raise _Pruned from exc
        if not chain:
            return []
        held, stream = self.receiver.version, self.receiver.stream_id
        if held is not None and stream == chain[0].stream_id:
            for position, manifest in enumerate(chain):
                if manifest.version == held:
                    return chain[position + 1:]
        log.info("re-seeding from v%d of stream %r (holding v%s of %r)", chain[0].version,
                 chain[0].stream_id, held, stream)
        return chain

    def _apply(self, manifest: Manifest) -> None:
        try:
            blobs = [read_verified(self.root, f, version=manifest.version)
                     for f in manifest.files]
        except FileNotFoundError as exc:
            if not (self.root / manifest.name).exists():
                raise _Pruned from exc
            raise CorruptFileError(Path(exc.filename).name, version=manifest.version,
                                   field="file", expected="present", got="missing") from None
        ack = self.receiver.receive(_payload(manifest, blobs))
        if not ack.accepted:
            raise RejectedVersionError(manifest.version, rejection=ack.rejection.value,
                                       detail=ack.detail, held=ack.version)
        if self.receiver.version != manifest.version:
            raise ManifestError(manifest.name, field="version",
                                expected=f"{self.receiver.version} (the payload's)",
                                got=manifest.version)
        if self.verify_weights:
            self._verify(manifest)
        log.debug("applied v%d (%s) from %s", manifest.version, manifest.kind.value,
                  manifest.name)

    def _verify(self, manifest: Manifest) -> None:
        weights = self.receiver.weights
        got = digests({n: weights[n] for n in manifest.tensors if n in weights})
        for name, expected in manifest.tensors.items():
            if got.get(name) != expected:
                self.receiver.version = self.receiver.stream_id = None
                raise WeightDigestError(name, version=manifest.version, expected=expected,
                                        got=got.get(name, "missing"))


def _payload(manifest: Manifest, blobs: list[bytes]) -> bytes:
    """The payload bytes of a version: the stored delta, or a full payload of the checkpoint."""
    if not manifest.is_full:
        tensors = safetensors.torch.load(blobs[0]) if len(blobs) == 1 else {}
        if set(tensors) != {PAYLOAD_TENSOR}:
            raise ManifestError(manifest.name, field="files",
                                expected=f"one file holding only {PAYLOAD_TENSOR!r}",
                                got=f"{len(blobs)} files holding {sorted(tensors)}")
        return tensors[PAYLOAD_TENSOR].numpy().tobytes()
    tensors = {}
    for blob in blobs:
        tensors.update(safetensors.torch.load(blob))
    return encode_full(tensors, stream_id=manifest.stream_id, version=manifest.version)
