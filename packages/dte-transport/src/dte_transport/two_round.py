"""Two-round exchange of byte buffers between the ranks of a ``torch.distributed`` group.

Round 1 is one collective: every rank contributes how many bytes it sends to each rank,
and every rank learns the whole size matrix. Round 2 moves the buffers with
point-to-point operations. Because every rank holds the same matrix, every rank derives
the same schedule: the pairs with bytes to move, in (source, destination) order, cut
into batches of at most ``max_ops`` pairs. Each rank walks all batches in that order
and posts the operations it takes part in, so no rank's local decision can leave a peer
waiting on an operation that never comes, and any world size works.

Coalesced (the default) posts each batch with ``batch_isend_irecv`` and waits for it as a
whole; the per-op variant sends and receives pair by pair, for comparison.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from .errors import LinkError

MAX_OPS = 64
"""Point-to-point pairs in flight per batch."""


def exchange(outgoing: Mapping[int, bytes], *, group: dist.ProcessGroup | None = None,
             device: torch.device | str = "cpu", coalesce: bool = True,
             max_ops: int = MAX_OPS) -> dict[int, bytes]:
    """Send ``outgoing[peer]`` to each peer and return what each peer sent here.

    Every rank of ``group`` must call this, with an empty mapping if it sends nothing.
    Ranks are the group's ranks. Buffers travel as uint8 tensors on ``device`` (a CUDA
    device for NCCL).

    Raises:
        LinkError: a collective or point-to-point operation failed (e.g. a peer died or
            the group's timeout passed); nothing is returned.
    """
    try:
        return _exchange(outgoing, group, torch.device(device), coalesce, max_ops)
    except (RuntimeError, dist.DistBackendError) as exc:
        raise LinkError(f"exchange over {dist.get_backend(group)} failed: {exc}") from exc


def size_matrix(outgoing: Mapping[int, bytes], group, device: torch.device) -> list[list[int]]:
    """Round 1: every rank's outgoing byte counts, as rows indexed by sending rank."""
    world = dist.get_world_size(group)
    mine = torch.zeros(world, dtype=torch.int64, device=device)
    for peer, data in outgoing.items():
        mine[peer] = len(data)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    return [row.tolist() for row in rows]


def _exchange(outgoing, group, device, coalesce, max_ops) -> dict[int, bytes]:
    me = dist.get_rank(group)
    sizes = size_matrix(outgoing, group, device)
    pairs = [(src, dst) for src, row in enumerate(sizes) for dst, n in enumerate(row)
             if n and src != dst]
    inbox = {src: torch.empty(sizes[src][me], dtype=torch.uint8, device=device)
             for src, dst in pairs if dst == me}
    for start in range(0, len(pairs), max_ops):
        ops = []
        for src, dst in pairs[start:start + max_ops]:
            if src == me:
                ops.append(dist.P2POp(dist.isend, _tensor(outgoing[dst], device),
                                      _peer(dst, group), group))
            elif dst == me:
                ops.append(dist.P2POp(dist.irecv, inbox[src], _peer(src, group), group))
        _run(ops, coalesce)
    received = {src: bytes(buffer.cpu().numpy()) for src, buffer in inbox.items()}
    if me in outgoing and outgoing[me]:
        received[me] = bytes(outgoing[me])
    return received


def _run(ops: list[dist.P2POp], coalesce: bool) -> None:
    if not ops:
        return
    if coalesce:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return
    for op in ops:
        op.op(op.tensor, op.peer, op.group).wait()


def _tensor(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _peer(rank: int, group) -> int:
    """P2POp wants the peer's global rank."""
    return rank if group is None else dist.get_global_rank(group, rank)
