"""The two-round exchange alone: any world size, frames with empty, uneven and segmented
bodies, batches of a few operations, coalesced and per-op, all ranks agreeing on one
schedule."""

from __future__ import annotations

import pytest
from group_worker import ranks, rendezvous
from two_round_worker import rank_main

pytestmark = [pytest.mark.distributed, pytest.mark.processes]


@pytest.mark.parametrize("world", [3, 5])
@pytest.mark.parametrize("coalesce", [True, False], ids=["coalesced", "per-op"])
def test_every_rank_gets_exactly_what_was_sent(world, coalesce, tmp_path):
    """Each rank receives exactly the frames addressed to it (header and body bytes)."""
    context = ranks()
    queue, store = context.Queue(), rendezvous(tmp_path)
    procs = [context.Process(target=rank_main, args=(r, world, store, world, coalesce, queue))
             for r in range(world)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=120) for _ in range(world))
    for proc in procs:
        proc.join(30)
    assert {r: True for r in range(world)} == results
