"""The receiving state machine: applies full payloads and deltas onto exactly their base."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, MutableMapping

import torch
from dte_codec import CodecError, Frame, Kind, Payload, decode_queued, warm_up
from dte_codec.digest import digests as tensor_digests
from dte_codec.apply import Prepared, prepare
from dte_codec.errors import ApplyError, MismatchError

from .ack import Ack, Rejection

log = logging.getLogger(__name__)

Stage = Callable[[Mapping[str, torch.Tensor], Payload], Prepared]
"""Checks a decoded payload against the live tensors and resolves it, writing nothing.
A stage that reads the payload through ``indices``, ``values`` or ``flat`` (``by_name``,
``areal_dte.ShardStage``) gets the entry by entry decode's where the batched decode gave
way (``Payload.settled``) and is called once; one that leaves the queued checks unread
is called again with that payload."""


def by_name(weights: Mapping[str, torch.Tensor], payload: Payload) -> Prepared:
    """The payload's tensors are the receiver's, by name (``dte_codec.apply.prepare``)."""
    return prepare(weights, [payload])


class Receiver:
    """Holds live tensors at one version of one stream and moves them forward.

    A full payload may arrive at any time and sets the stream and version. A delta is
    applied only onto exactly its base version of the same stream; anything else is
    rejected and leaves the tensors and the version as they were.

    Args:
        weights: the live tensors.
        device: where payloads are decoded; by default where the live tensors are (a
            frame whose body is already there is decoded in place, with no copy).
        stage: how a payload maps onto ``weights``; another layout (the rollout's fused,
            sharded tensors) brings its own.

    Built on a CUDA device, it compiles the codec's kernels first (``dte_codec.warm_up``).
    """

    def __init__(self, weights: MutableMapping[str, torch.Tensor], *,
                 device: str | torch.device | None = None, stage: Stage = by_name):
        self.weights = weights
        self.device = torch.device(device) if device is not None else next(
            (t.device for t in weights.values()), torch.device("cpu"))
        self.stage = stage
        # compile the codec's kernels now, not in the first sync
        warm_up(self.device, payloads=[t.dtype for t in weights.values()])
        self.version: int | None = None
        self.stream_id: str | None = None

    def receive(self, data: Frame | bytes, *, digests: Mapping[str, str] | None = None
                ) -> Ack:
        """Decode, check and apply one payload; never raises for bad payloads.

        Args:
            data: the payload, a frame or its bytes.
            digests: the sender's ``dte_codec.digests`` of its own weights after this
                version, by the receiver's tensor names; when given, every named tensor
                must match after the write, else a delta is rolled back and refused
                (``Rejection.DIGEST_MISMATCH``).
        """
        try:
            # on a GPU the body's checks stay queued: a stage that reads them with its own
            # summary (ShardStage) has the delta with one host synchronization
            payload = decode_queued(data, device=self.device)
        except CodecError as exc:
            return self._reject(Rejection.BAD_PAYLOAD, exc)
        header = payload.header
        if header.kind == Kind.DELTA:
            refused = None
            if header.stream_id != self.stream_id:
                refused = (Rejection.WRONG_STREAM, f"delta of stream {header.stream_id!r}, "
                           f"holding {self.stream_id!r}")
            elif header.base_version != self.version:
                refused = (Rejection.WRONG_BASE, f"delta onto version {header.base_version}, "
                           f"holding {self.version}")
            if refused is not None:
                return self._reject(*(_bad(payload) or refused))
        check = None if digests is None else lambda: self._check_digests(digests)
        try:
            try:
                prepared = self.stage(self.weights, payload)
            except CodecError:
                payload.settled()  # a bad payload is refused as such, before a misfit
                raise
            unread = payload.checks is not None
            settled = payload.settled()
            if unread and settled is not payload:  # staged on what the checks refused
                prepared = self.stage(self.weights, settled)
            prepared.write(check=check)
        except _DigestMismatch as exc:
            if header.kind == Kind.FULL:
                self.version = self.stream_id = None
            return self._reject(Rejection.DIGEST_MISMATCH, exc)
        except MismatchError as exc:
            return self._reject(Rejection.MISMATCH, exc)
        except ApplyError as exc:
            if header.kind == Kind.FULL:
                self.version = self.stream_id = None
            return self._reject(Rejection.APPLY_FAILED, exc)
        except CodecError as exc:
            return self._reject(Rejection.BAD_PAYLOAD, exc)
        self.version, self.stream_id = header.payload_version, header.stream_id
        log.debug("applied %s v%d (%d entries)", header.kind.name.lower(), self.version,
                  len(header.entries))
        return Ack(accepted=True, version=self.version)

    def _check_digests(self, expected: Mapping[str, str]) -> None:
        missing = sorted(expected.keys() - self.weights.keys())
        if missing:
            raise _DigestMismatch(f"no tensor {missing[0]!r} to compare with the sender's digest")
        held = tensor_digests({name: self.weights[name] for name in expected})
        differ = sorted(name for name, value in expected.items() if held[name] != value)
        if differ:
            raise _DigestMismatch(f"{len(differ)} tensors differ from the sender's weights after "
                                  f"applying, e.g. {differ[0]!r}")

    def _reject(self, rejection: Rejection, detail: object) -> Ack:
        log.warning("rejected payload (%s): %s; staying at version %s", rejection.value, detail,
                    self.version)
        return Ack(accepted=False, version=self.version, rejection=rejection, detail=str(detail))


def _bad(payload: Payload) -> tuple[Rejection, CodecError] | None:
    """``BAD_PAYLOAD`` with the decode's error where ``payload``'s checks fail."""
    try:
        payload.settled()
    except CodecError as exc:
        return Rejection.BAD_PAYLOAD, exc
    return None


class _DigestMismatch(Exception):
    """Raised inside the write's check; becomes a ``DIGEST_MISMATCH`` rejection."""
