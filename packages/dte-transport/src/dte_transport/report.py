"""What one sync did, and the shared timer that measures its phases."""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Iterator

import attrs
import torch


class SyncKind(enum.Enum):
    FULL = "full"
    """A full sync: first one, after a rejection, or asked for by the caller."""
    DELTA = "delta"
    ANCHOR = "anchor"
    """A full sync because ``anchor_interval`` deltas were committed since the last one."""


@attrs.define
class Timer:
    """Accumulates wall-clock milliseconds per phase."""

    ms: dict[str, float] = attrs.field(factory=dict)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:  # a named range in torch.profiler's tables and traces; ~1 us when not profiling
            with torch.profiler.record_function(f"dte.{name}"):
                yield
        finally:
            self.ms[name] = self.ms.get(name, 0.0) + (time.perf_counter() - start) * 1e3


@attrs.frozen(kw_only=True)
class SyncReport:
    """One delivered version."""

    version: int
    kind: SyncKind
    reason: str
    """Why this kind: ``"delta"``, ``"no_base"``, ``"anchor_due"``, ``"delta_rejected: ..."`` or
    the caller's reason for a forced full sync."""
    base_version: int | None
    payload_bytes: int
    """Bytes put on the link for this version (a rejected delta's bytes included)."""
    dense_bytes: int
    """What a full sync of the same tensors costs."""
    changed: int | None
    """Elements in the delta's change sets (None for full syncs)."""
    ms: dict[str, float]
    """Milliseconds per phase: ``detect``, ``encode``, ``send`` (delivery, decode and apply)."""
