"""What each spawned rank runs in ``test_two_round.py``."""

from __future__ import annotations

import datetime
import os
import random

import torch.distributed as dist
from dte_transport.two_round import exchange


def payload(src: int, dst: int, seed: int) -> bytes:
    """What ``src`` sends ``dst``: empty for some pairs, up to a few KiB for others."""
    rng = random.Random(seed * 1000 + src * 37 + dst)
    return rng.randbytes(rng.choice([0, 0, 1, 7, 4096]))


def rank_main(rank: int, world: int, store: str, seed: int, coalesce: bool, queue) -> None:
    dist.init_process_group("gloo", init_method=store, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=20))
    outgoing = {dst: payload(rank, dst, seed) for dst in range(world) if dst != rank}
    received = exchange({d: b for d, b in outgoing.items() if b}, coalesce=coalesce, max_ops=2)
    expected = {src: payload(src, rank, seed) for src in range(world) if src != rank}
    queue.put((rank, {s: b for s, b in expected.items() if b} == received))
    queue.close()
    queue.join_thread()  # the result is in the pipe before the process ends without teardown
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)
