"""The all-reduced decisions of a group sync (``group``): full or delta, and the vote.

``agree`` all-reduces (MAX) one vector of flags and bounds from every rank, so every rank
derives the same decision; ``vote`` all-reduces the worst rejection and, when there is
one, gathers every refusing rank's reason, so trainers can report the rollout's words.
"""

from __future__ import annotations

import enum

import attrs
import torch
import torch.distributed as dist
import xxhash

from .ack import Rejection
from .errors import LinkError
from .report import SyncKind
from .sender import ANCHOR_DUE, DELTA, NO_BASE

FORCED = "forced"
ROLLOUT_VETO = "rollout_veto"
BASE_MISMATCH = "base_mismatch"
REJECTIONS = tuple(Rejection)


class Slot(enum.IntEnum):
    """Positions in the agreement vector (all-reduced with MAX)."""

    NO_BASE = 0
    ANCHOR_DUE = 1
    FORCED = 2
    VETO = 3
    BASE_HIGH = 4
    BASE_LOW_NEG = 5
    STREAM_HIGH = 6
    STREAM_LOW_NEG = 7


@attrs.frozen
class Decision:
    kind: SyncKind
    reason: str
    base: int | None


def stream_key(stream_id: str | None) -> int:
    return -1 if stream_id is None else xxhash.xxh3_64_intdigest(stream_id.encode()) >> 1


def all_reduce_max(values: list[int], group, device) -> list[int]:
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    try:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    except (RuntimeError, dist.DistBackendError) as exc:
        raise LinkError(f"all-reduce over {dist.get_backend(group)} failed: {exc}") from exc
    return tensor.tolist()


def agree(vote: list[int], group, device) -> Decision:
    got = all_reduce_max(vote, group, device)
    base_high, base_low = got[Slot.BASE_HIGH], -got[Slot.BASE_LOW_NEG]
    reasons = [(got[Slot.NO_BASE], NO_BASE), (got[Slot.ANCHOR_DUE], ANCHOR_DUE),
               (got[Slot.FORCED], FORCED), (got[Slot.VETO], ROLLOUT_VETO),
               (base_high != base_low, BASE_MISMATCH),
               (got[Slot.STREAM_HIGH] != -got[Slot.STREAM_LOW_NEG], BASE_MISMATCH)]
    reason = next((why for flag, why in reasons if flag), None)
    if reason is None:
        return Decision(SyncKind.DELTA, DELTA, base_high)
    kind = SyncKind.ANCHOR if reason == ANCHOR_DUE else SyncKind.FULL
    return Decision(kind, reason, None)


def vote(rejection: Rejection | None, detail: str, group, device
          ) -> tuple[Rejection | None, str]:
    """The worst rejection of all ranks and, when there is one, every refusing rank's
    reason (gathered over the group: one more collective, on every rank alike)."""
    code = 0 if rejection is None else REJECTIONS.index(rejection) + 1
    (worst,) = all_reduce_max([code], group, device)
    if worst == 0:
        return None, ""
    details: list[str] = [""] * dist.get_world_size(group)
    try:
        dist.all_gather_object(details, detail if rejection is not None else "", group=group)
    except (RuntimeError, dist.DistBackendError) as exc:
        raise LinkError(f"gathering refusals over {dist.get_backend(group)} failed: {exc}"
                        ) from exc
    return REJECTIONS[worst - 1], "; ".join(f"rank {rank}: {text}"
                                            for rank, text in enumerate(details) if text)
