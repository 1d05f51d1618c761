"""Two-round exchange of payload frames between the ranks of a ``torch.distributed`` group.

Round 1 is one collective: every rank contributes how many header and body bytes it
sends to each rank, and every rank learns the whole size matrix. Round 2 moves the
frames with point-to-point operations, a frame's header (a few KiB, from the host) and
its body (a tensor on ``device``, straight from where it was encoded: no host copy) as
two operations. Because every rank holds the same matrix, every rank derives the same
schedule: the pairs with a frame to move, in (source, destination) order, cut into
batches of at most ``max_ops`` pairs. Each rank walks all batches in that order and
posts the operations it takes part in, so no rank's local decision can leave a peer
waiting on an operation that never comes, and any world size works.

Coalesced (the default) posts each batch with ``batch_isend_irecv`` and waits for it as a
whole; the per-op variant sends and receives pair by pair, for comparison.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from dte_codec import Frame

from .errors import LinkError

MAX_OPS = 64
"""Point-to-point pairs in flight per batch."""


def exchange(outgoing: Mapping[int, Frame], *, group: dist.ProcessGroup | None = None,
             device: torch.device | str = "cpu", coalesce: bool = True,
             max_ops: int = MAX_OPS) -> dict[int, Frame]:
    """Send ``outgoing[peer]`` to each peer and return the frame each peer sent here.

    Every rank of ``group`` must call this, with an empty mapping if it sends nothing.
    Ranks are the group's ranks. Bodies travel as uint8 tensors on ``device`` (a CUDA
    device for NCCL); a received frame's body is one tensor there. A frame sent to this
    rank itself comes back as it is.

    Raises:
        LinkError: a collective or point-to-point operation failed (e.g. a peer died or
            the group's timeout passed); nothing is returned.
    """
    try:
        return _exchange(outgoing, group, torch.device(device), coalesce, max_ops)
    except (RuntimeError, dist.DistBackendError) as exc:
        raise LinkError(f"exchange over {dist.get_backend(group)} failed: {exc}") from exc


def size_matrix(outgoing: Mapping[int, Frame], group, device: torch.device
                ) -> list[list[tuple[int, int]]]:
    """Round 1: per sending rank (rows) and destination, (header, body) byte counts."""
    world = dist.get_world_size(group)
    mine = torch.zeros(world, 2, dtype=torch.int64)
    for peer, frame in outgoing.items():
        mine[peer, 0], mine[peer, 1] = len(frame.header), frame.body_size
    rows = [torch.empty_like(mine, device=device) for _ in range(world)]
    dist.all_gather(rows, mine.to(device), group=group)
    return [[tuple(pair) for pair in row.tolist()] for row in rows]


def _exchange(outgoing, group, device, coalesce, max_ops) -> dict[int, Frame]:
    me = dist.get_rank(group)
    sizes = size_matrix(outgoing, group, device)
    pairs = [(src, dst) for src, row in enumerate(sizes) for dst, (head, _) in enumerate(row)
             if head and src != dst]
    heads = {src: torch.empty(sizes[src][me][0], dtype=torch.uint8, device=device)
             for src, dst in pairs if dst == me}
    bodies = {src: torch.empty(sizes[src][me][1], dtype=torch.uint8, device=device)
              for src, dst in pairs if dst == me}
    for start in range(0, len(pairs), max_ops):
        ops = []
        for src, dst in pairs[start:start + max_ops]:
            if src == me:
                frame = outgoing[dst]
                ops += _ops(dist.isend, _head(frame, device), frame.body().to(device), dst, group)
            elif dst == me:
                ops += _ops(dist.irecv, heads[src], bodies[src], src, group)
        _run(ops, coalesce)
    received = {src: Frame(bytes(heads[src].cpu().numpy()), (bodies[src],)) for src in heads}
    if me in outgoing:
        received[me] = outgoing[me]
    return received


def _ops(op, head: torch.Tensor, body: torch.Tensor, peer: int, group) -> list[dist.P2POp]:
    ops = [dist.P2POp(op, head, _peer(peer, group), group)]
    if body.numel():
        ops.append(dist.P2POp(op, body, _peer(peer, group), group))
    return ops


def _run(ops: list[dist.P2POp], coalesce: bool) -> None:
    if not ops:
        return
    if coalesce:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return
    for op in ops:
        op.op(op.tensor, op.peer, op.group).wait()


def _head(frame: Frame, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(frame.header), dtype=torch.uint8).to(device)


def _peer(rank: int, group) -> int:
    """P2POp wants the peer's global rank."""
    return rank if group is None else dist.get_global_rank(group, rank)
