"""The writer of a staged-file store: a ``Link`` that commits each payload as files.

Full versions are plain safetensors checkpoints of the tensors (sharded at
``max_file_bytes``); a delta is its exact payload bytes as one uint8 tensor. A version
is committed when its manifest is renamed into place (see ``manifest``); it is written
last, after every data file is fsynced and renamed, so a writer killed at any point
leaves no partial version visible. Every full version prunes all older ones, so the
store holds the latest full version plus the deltas after it.

The writer keeps its own copy of the latest version's tensors (host memory, one model
copy) and applies each payload to it before writing anything: a payload that a reader
would refuse (bad bytes, wrong stream or base, mismatched tensors) is refused here and
never reaches the store, and the manifest can carry the digest of every tensor after
the version. One writer per store at a time (an exclusive ``flock`` on ``.lock``).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import safetensors.torch
import torch
from dte_codec import CodecError, Frame, Header, Kind, digests

from .ack import Ack, Rejection
from .durable import TEMP_PREFIX, fsync_dir, write_durable
from .errors import LinkError, StoreLockedError
from .manifest import (FORMAT, HIDDEN_PREFIX, MANIFEST_SUFFIX, SEQUENCE_WIDTH, Manifest,
                       StoredKind, committed)
from .receiver import Receiver

log = logging.getLogger(__name__)

LOCK_NAME = HIDDEN_PREFIX + "lock"
PAYLOAD_TENSOR = "payload"
"""The one tensor of a delta file: the payload bytes as uint8."""
DEFAULT_MAX_FILE_BYTES = 4 * 2**30
_STORE_FILE = re.compile(r"^\d+(-v\d+-(full|anchor|delta)(-\d+-of-\d+)?\.safetensors|"
                         + re.escape(MANIFEST_SUFFIX) + ")$")
"""Names this store writes; nothing else in the directory is ever deleted."""


class StagedLink:
    """A ``Link`` that writes each accepted payload as a committed version under ``root``.

    ``send`` returns ``Ack(accepted=True)`` once the manifest is durable, a rejected
    ``Ack`` (nothing written) for a payload the store cannot take, and raises
    ``LinkError`` when writing fails; after a failure only a full payload is accepted.
    Like ``Loopback`` it counts ``messages`` and ``bytes_sent``. Not thread-safe.

    Args:
        root: the store's directory (created if missing).
        max_file_bytes: full versions are split into safetensors files of about this size.

    Raises:
        StoreLockedError: another writer holds the store.
    """

    def __init__(self, root: str | os.PathLike, *, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_file_bytes = max_file_bytes
        self.messages = 0
        self.bytes_sent = 0
        self._lock = _lock(self.root)
        manifests = committed(self.root)
        self._sequence = manifests[-1].sequence if manifests else 0
        self._shadow = Receiver({})
        self._digests: dict[str, str] = {}
        self._before_commit: Callable[[], None] | None = None
        """Test hook: called after the manifest is fsynced, right before its rename."""
        self._delete(self._unreferenced(keep=manifests), "left by an earlier writer")

    def close(self) -> None:
        """Release the store's lock."""
        self._lock.close()

    def __enter__(self) -> StagedLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, frame: Frame | bytes, *, digests: Mapping[str, str] | None = None) -> Ack:
        """Commit ``frame`` as a version of the store.

        Args:
            frame: the payload, a frame (a delta's is written as its bytes, a full one's
                body comes to the host tensor by tensor) or its bytes.
            digests: the sender's ``dte_codec.digests`` of its weights after this version;
                the writer's replay must match them or the version is refused with
                ``Rejection.DIGEST_MISMATCH`` (nothing written), and the manifest carries
                them, so a reader's ``verify_weights`` checks against the trainer's bytes.
                Without them the manifest carries the replay's digests.

        Raises:
            LinkError: a file could not be written; nothing new is visible to readers.
        """
        self.messages += 1
        self.bytes_sent += frame.nbytes if isinstance(frame, Frame) else len(frame)
        try:
            header = (Header.unpack_head(memoryview(frame.header), frame.body_size)
                      if isinstance(frame, Frame) else Header.unpack(memoryview(frame))[0])
        except CodecError as exc:
            return self._refuse(Rejection.BAD_PAYLOAD, exc)
        try:
            if header.kind == Kind.FULL:
                return self._send_full(header, frame, digests)
            return self._send_delta(header, bytes(frame), digests)
        except BaseException as exc:
            self._shadow, self._digests = Receiver({}), {}
            if isinstance(exc, OSError):
                raise LinkError(f"staged store {str(self.root)!r}: writing version "
                                f"{header.payload_version} failed: {exc}") from exc
            raise

    def _send_full(self, header: Header, frame: Frame | bytes,
                   expected: Mapping[str, str] | None) -> Ack:
        held = self._shadow
        kind = (StoredKind.ANCHOR if held.version is not None
                and held.stream_id == header.stream_id else StoredKind.FULL)
        self._shadow, self._digests = Receiver({}), {}  # one model copy at a time
        shadow = Receiver({e.name: torch.empty(e.shape, dtype=e.dtype) for e in header.entries})
        ack = shadow.receive(frame, digests=expected)
        if not ack.accepted:
            return ack
        tensors = shadow.weights
        tensor_digests = dict(expected) if expected is not None else digests(tensors)
        shards = list(_shards(tensors, self.max_file_bytes))
        files = ((_data_name(self._sequence + 1, header, kind, i, len(shards)),
                  safetensors.torch.save(shard, metadata=_metadata(header, kind)))
                 for i, shard in enumerate(shards))  # one shard's bytes in memory at a time
        manifest = self._commit(header, kind, files, tensor_digests)
        self._shadow, self._digests = shadow, tensor_digests
        self._delete(self._unreferenced(keep=[manifest]), "older than the new full version")
        return Ack(accepted=True, version=header.payload_version)

    def _send_delta(self, header: Header, data: bytes, expected: Mapping[str, str] | None
                    ) -> Ack:
        ack = self._shadow.receive(data, digests=expected)
        if not ack.accepted:
            return ack
        self._digests.update(expected if expected is not None else digests(
            {e.name: self._shadow.weights[e.name] for e in header.entries}))
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        name = _data_name(self._sequence + 1, header, StoredKind.DELTA, 0, 1)
        files = [(name, safetensors.torch.save({PAYLOAD_TENSOR: payload},
                                               metadata=_metadata(header, StoredKind.DELTA)))]
        self._commit(header, StoredKind.DELTA, files, dict(self._digests))
        return Ack(accepted=True, version=header.payload_version)

    def _commit(self, header: Header, kind: StoredKind, files: Iterable[tuple[str, bytes]],
                tensor_digests: dict[str, str]) -> Manifest:
        staged = tuple(write_durable(self.root, name, blob) for name, blob in files)
        fsync_dir(self.root)  # the data files' names are durable before the manifest's
        manifest = Manifest(sequence=self._sequence + 1, stream_id=header.stream_id,
                            version=header.payload_version, kind=kind,
                            base_version=None if header.kind == Kind.FULL else header.base_version,
                            files=staged, tensors=tensor_digests)
        write_durable(self.root, manifest.name, manifest.to_json(),
                      before_rename=self._before_commit)
        fsync_dir(self.root)
        self._sequence = manifest.sequence
        log.debug("committed v%d (%s) as %s, %d B in %d files", manifest.version,
                  kind.value, manifest.name, sum(f.size for f in staged), len(staged))
        return manifest

    def _unreferenced(self, *, keep: list[Manifest]) -> list[str]:
        """Store files (and temporaries) that no manifest in ``keep`` refers to."""
        referenced = {m.name for m in keep} | {f.name for m in keep for f in m.files}
        names = (n for n in os.listdir(self.root) if n not in referenced)
        return sorted(n for n in names if n.startswith(TEMP_PREFIX) or _STORE_FILE.match(n))

    def _delete(self, names: list[str], why: str) -> None:
        # Manifests first: a version disappears before its files do.
        ordered = sorted(names, key=lambda n: not n.endswith(MANIFEST_SUFFIX))
        try:
            for name in ordered:
                with contextlib.suppress(FileNotFoundError):
                    (self.root / name).unlink()
            if ordered:
                fsync_dir(self.root)
        except OSError as exc:  # the new version is committed; the next full prunes again
            log.warning("staged store %s: pruning files %s failed: %s", self.root, why, exc)
            return
        if ordered:
            log.debug("pruned %d files %s", len(ordered), why)

    def _refuse(self, rejection: Rejection, detail: object) -> Ack:
        log.warning("staged store %s refused a payload (%s): %s", self.root, rejection.value,
                    detail)
        return Ack(accepted=False, version=self._shadow.version, rejection=rejection,
                   detail=str(detail))


def _lock(root: Path):
    handle = open(root / LOCK_NAME, "a+b")  # noqa: SIM115 - held for the link's lifetime
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise StoreLockedError(root) from None
    return handle


def _data_name(sequence: int, header: Header, kind: StoredKind, index: int, count: int) -> str:
    shard = f"-{index + 1:05d}-of-{count:05d}" if count > 1 else ""
    return (f"{sequence:0{SEQUENCE_WIDTH}d}-v{header.payload_version}-{kind.value}{shard}"
            ".safetensors")


def _metadata(header: Header, kind: StoredKind) -> dict[str, str]:
    return {"format": FORMAT, "stream_id": header.stream_id,
            "version": str(header.payload_version), "kind": kind.value}


def _shards(tensors: Mapping[str, torch.Tensor], limit: int) -> Iterator[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most ``limit`` bytes (a larger tensor alone)."""
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > limit:
            yield shard
            shard, size = {}, 0
        shard[name] = tensor
        size += nbytes
    if shard or not tensors:
        yield shard
