"""Windows of a full version: bounded in bytes, covering every transfer exactly once."""

from __future__ import annotations

import math

import torch
from dte_codec.geometry import Transfer
from dte_codec.region import Box
from dte_transport.windows import windows


def _transfer(rank: int, name: str, shape, start, size, source_start=None) -> Transfer:
    return Transfer(target_rank=rank, target_tensor=name, target_shape=shape,
                    source_box=Box(source_start or (0,) * len(size), size),
                    target_box=Box(start, size))


def _plan():
    return {"a": (_transfer(1, "qkv", (12, 8), (0, 0), (10, 8)),
                  _transfer(2, "qkv", (12, 8), (0, 0), (2, 8), source_start=(10, 0))),
            "b": (_transfer(1, "norm", (1, 40), (0, 0), (1, 40)),),
            "c": (_transfer(1, "wide", (2, 40), (0, 0), (2, 40)),)}


def _weights():
    return {"a": torch.zeros(12, 8, dtype=torch.bfloat16),
            "b": torch.zeros(1, 40, dtype=torch.float32),
            "c": torch.zeros(2, 40, dtype=torch.float32)}


def test_windows_are_bounded_and_cover_each_transfer_once():
    """Windows hold at most the limit (rows of 16 bytes, limit 40: two rows of the 10 x 8
    bf16 box per piece; the 1 x 40 box is cut along its second dimension, the first of
    more than one element); the pieces tile each transfer's target box in order."""
    got = windows(_plan(), _weights(), 1, 40)
    sizes = [sum(t.target_box.numel * (2 if n == "a" else 4) for n, t in w) for w in got]
    assert all(s <= 40 for s, w in zip(sizes, got) if all(n != "c" for n, _ in w))
    assert [(0, 0), (2, 0), (4, 0), (6, 0), (8, 0)] == [t.target_box.start for w in got
                                                        for n, t in w if n == "a"]
    assert [(0, 0), (0, 10), (0, 20), (0, 30)] == [t.target_box.start for w in got
                                                   for n, t in w if n == "b"]
    for name, numel in (("a", 80), ("b", 40), ("c", 80)):
        assert numel == sum(t.target_box.numel for w in got for n, t in w if n == name)


def test_a_row_over_the_limit_travels_alone():
    """Rows of 160 bytes cannot be cut to 40: each is a window of its own."""
    got = windows(_plan(), _weights(), 1, 40)
    assert [[("c", (1, 40))], [("c", (1, 40))]] == [
        [(n, t.target_box.size) for n, t in w] for w in got if any(n == "c" for n, _ in w)]


def test_source_and_target_rows_move_together():
    """Cutting keeps source and target boxes aligned row for row."""
    got = windows(_plan(), _weights(), 2, 16)
    assert [((10, 0), (0, 0)), ((11, 0), (1, 0))] == [
        (t.source_box.start, t.target_box.start) for w in got for _, t in w]
    assert all(math.prod(t.source_box.size) == t.target_box.numel for w in got for _, t in w)


def test_a_rank_with_nothing_gets_one_empty_window():
    """A rank that no transfer reaches still gets one (empty) window: its version."""
    assert [[]] == windows(_plan(), _weights(), 3, 40)
