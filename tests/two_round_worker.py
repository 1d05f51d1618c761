"""What each rank process runs in ``test_two_round.py``."""

from __future__ import annotations

import datetime
import os
import random

import torch
import torch.distributed as dist
from dte_codec import Frame
from dte_transport.two_round import exchange


def payload(src: int, dst: int, seed: int) -> Frame | None:
    """What ``src`` sends ``dst``: nothing for some pairs, else a header and a body of
    0 to a few KiB in one to three segments."""
    rng = random.Random(seed * 1000 + src * 37 + dst)
    if rng.random() < 0.3:
        return None
    segments = [torch.frombuffer(bytearray(rng.randbytes(rng.choice([1, 7, 4096]))),
                                 dtype=torch.uint8) for _ in range(rng.choice([0, 1, 3]))]
    return Frame(rng.randbytes(rng.choice([1, 64])), segments)


def _content(frame: Frame | None):
    return None if frame is None else (frame.header, bytes(frame.body().numpy()))


def rank_main(rank: int, world: int, store: str, seed: int, coalesce: bool, queue) -> None:
    dist.init_process_group("gloo", init_method=store, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=20))
    outgoing = {dst: payload(rank, dst, seed) for dst in range(world) if dst != rank}
    received = exchange({d: f for d, f in outgoing.items() if f}, coalesce=coalesce, max_ops=2)
    expected = {src: payload(src, rank, seed) for src in range(world) if src != rank}
    queue.put((rank, {s: _content(f) for s, f in expected.items() if f}
               == {s: _content(f) for s, f in received.items()}))
    queue.close()
    queue.join_thread()  # the result is in the pipe before the process ends without teardown
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)
