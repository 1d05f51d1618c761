"""The actor side of the delta path over tensors handed over bucket by bucket.

AReaL's Megatron engine walks the model once per weight update and hands the weights over
in buckets of Hugging Face-named tensors, TP- and EP-gathered, on the pipeline head.
`BucketSync` takes each bucket with `add` (a host copy) and, once the walk is over, sends
the version with `sync`: one payload over all tensors, through a `dte_transport.Sender`
(first version full, later ones deltas onto the version the receiver acknowledged, a full
anchor after every ``anchor_interval`` committed deltas).

Changes are found by the snapshot detector: a bitwise diff against the host copy of the
last committed version. It costs one host copy of the model and is exact for any
optimizer and any number of steps between syncs; ``adamw`` and ``cast`` need hooks inside
Megatron's optimizer that are not wired here.

A version the link could not deliver (``SyncError``: links that cannot carry a receiver's
refusal report it as a failure) is sent once more in full, which any receiver accepts
whatever version it holds; a second failure raises.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from dte_detector import Snapshot
from dte_transport import Sender, SyncError, SyncReport

from .errors import DeltaSyncError

__all__ = ["BucketSync"]

log = logging.getLogger(__name__)

RESYNC = "resync"
"""Reason of the full sync that follows a version the link could not deliver."""
HOST = torch.device("cpu")


class BucketSync:
    """Collects one version's tensors bucket by bucket and sends them as one payload.

    Args:
        sender: delivers versions of the whole model to the rollout.
    """

    def __init__(self, sender: Sender):
        self.sender = sender
        self._snapshot = Snapshot()
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_version: int | None = None
        self._committed: frozenset[str] | None = None
        """Names of the last version sent; every later version must hand over the same."""

    def add(self, named_tensors: Sequence[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Keep a host copy of one bucket of ``version``.

        Buckets of an older version that was never sent (its walk failed midway) are
        dropped when the first bucket of a newer one arrives.

        Raises:
            DeltaSyncError: a tensor arrives twice within one version.
        """
        if version != self._pending_version:
            self._pending, self._pending_version = {}, version
        for name, tensor in named_tensors:
            if name in self._pending:
                raise DeltaSyncError(f"v{version} tensor {name!r}", expected="handed over once",
                                     got="a second time")
            self._pending[name] = tensor.detach().to(HOST, copy=True).contiguous()

    def sync(self, *, version: int) -> SyncReport:
        """Send every tensor added for ``version`` as one version; forget them after.

        Raises:
            DeltaSyncError: nothing was added for ``version``, or not the same tensors as
                for the last version sent (a walk that missed a tensor would otherwise
                leave it stale under a delta); nothing is sent.
            SyncError: the version was not delivered, not even in full on a second try.
        """
        if version != self._pending_version or not self._pending:
            raise DeltaSyncError(f"v{version} tensors", expected="at least one bucket added",
                                 got=f"buckets of v{self._pending_version}")
        weights, self._pending, self._pending_version = self._pending, {}, None
        if self._committed is not None and weights.keys() != self._committed:
            missing, extra = sorted(self._committed - weights.keys()), sorted(weights.keys()
                                                                            - self._committed)
            raise DeltaSyncError(f"v{version} tensors",
                                 expected=f"the {len(self._committed)} tensors sent before",
                                 got=f"{len(weights)}, missing {missing[:3]}, new {extra[:3]}")
        try:
            report = self.sender.sync(weights, version=version, changes=lambda: {
                name: self._snapshot.changes(name, tensor) for name, tensor in weights.items()})
        except SyncError as failed:
            log.warning("v%d not delivered (%s); sending it in full once more", version,
                        failed.detail)
            report = self.sender.sync_full(weights, version=version,
                                           reason=f"{RESYNC}: {failed.detail}")
        for name, tensor in weights.items():  # add() made them: no second host copy
            self._snapshot.retain(name, tensor, copy=False)
        self._committed = frozenset(weights)
        return report
