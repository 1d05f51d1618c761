"""``remap_flat`` (``remap_all``'s GPU path) equals ``remap`` tensor by tensor, bit for bit,
over random plans; on the CPU it runs the same torch ops as on a GPU."""

from __future__ import annotations

import math

import pytest
import torch
from dte_codec.batched_remap import RemapItem, remap_flat
from dte_codec.errors import GeometryError
from dte_codec.geometry import Box, Transfer, plan
from dte_codec.remap import remap
from hypothesis import example, given
from hypothesis import strategies as st
from plan_strategies import BACK, PINNED, cases, shards


def _random_items(case, order: str) -> list[RemapItem]:
    """Every tensor of every source rank of ``case`` with a random set of changed flat
    indices (``order``: sorted or shuffled; int32 or int64 at random)."""
    config, source, target, seed, rate = case
    gen = torch.Generator().manual_seed(seed)
    targets = shards(config, target)
    items = []
    for shard in shards(config, source):
        for name, transfers in plan(shard, targets).items():
            shape = shard.tensors[name].shape
            numel = math.prod(shape)
            chosen = torch.nonzero(torch.rand(numel, generator=gen) < rate).view(-1)
            if order == "shuffled":
                chosen = chosen[torch.randperm(chosen.numel(), generator=gen)]
            dtype = (torch.int32, torch.int64)[int(torch.randint(2, (), generator=gen))]
            items.append(RemapItem(transfers, shape, chosen.to(dtype), tensor=name))
    return items


def _differences(items: list[RemapItem]) -> list[str]:
    """Where ``remap_flat`` and ``remap`` disagree: target sets, dtypes, any index or
    position bit."""
    found = []
    for item, got in zip(items, remap_flat(items), strict=True):
        expected = remap(item.transfers, item.source_shape, item.indices, tensor=item.tensor)
        if expected.keys() != got.keys():
            found.append(f"{item.tensor}: targets {sorted(expected)} != {sorted(got)}")
            continue
        for key, want in expected.items():
            have = got[key]
            if (want.indices.dtype != have.indices.dtype
                    or not torch.equal(want.indices, have.indices)
                    or not torch.equal(want.positions, have.positions)):
                found.append(f"{item.tensor} -> {key}")
    return found


@given(case=cases(), order=st.sampled_from(["sorted", "shuffled"]))
@example(case=PINNED, order="shuffled")
@example(case=BACK, order="sorted")
def test_remap_flat_equals_remap_per_tensor(case, order):
    """Every source rank's tensors in one call (many geometries, replicated and split
    targets, Megatron TP/PP/EP to SGLang TP/EP with padded vocabs and back): each item
    gets exactly ``remap``'s targets, index dtypes, indices and positions."""
    assert [] == _differences(_random_items(case, order))


def _transfer(rank: int, name: str, shape: tuple[int, ...], source: Box, target: Box) -> Transfer:
    return Transfer(target_rank=rank, target_tensor=name, target_shape=shape,
                    source_box=source, target_box=target)


# Column blocks of a (4, 6) tensor into one (4, 6) target, swapped: its boxes interleave
# in the target's flat order, so its pairs need the sort that the others skip.
SWAPPED = (_transfer(0, "t", (4, 6), Box((0, 0), (4, 3)), Box((0, 3), (4, 3))),
           _transfer(0, "t", (4, 6), Box((0, 3), (4, 3)), Box((0, 0), (4, 3))))
ROWS = (_transfer(1, "r", (2, 6), Box((0, 0), (2, 6)), Box((0, 0), (2, 6))),
        _transfer(0, "r", (2, 6), Box((2, 0), (2, 6)), Box((0, 0), (2, 6))))
VECTOR = (_transfer(0, "v", (5,), Box((0,), (3,)), Box((2,), (3,))),
          _transfer(1, "v", (3,), Box((0,), (3,)), Box((0,), (3,))))


def test_remap_flat_sorts_only_what_interleaves_and_keeps_empty_targets():
    """Interleaving boxes, split rows, a replicated 1-D tensor, an empty index set and a
    tensor with no plan in one call: each equals ``remap``; empty targets stay."""
    items = [RemapItem(SWAPPED, (4, 6), torch.tensor([23, 0, 5, 2, 12, 9])),
             RemapItem(ROWS, (4, 6), torch.tensor([3, 20, 7, 14], dtype=torch.int32)),
             RemapItem(VECTOR, (3,), torch.tensor([2, 0])),
             RemapItem(ROWS, (4, 6), torch.tensor([], dtype=torch.int64)),
             RemapItem((), (4, 6), torch.tensor([1]))]
    assert [] == _differences(items)
    out = remap_flat(items)
    # hand-checked: (row, col) -> (row, col +- 3), sorted in the target
    assert [2, 3, 5, 6, 15, 20] == out[0][(0, "t")].indices.tolist()
    assert [2, 1, 3, 5, 4, 0] == out[0][(0, "t")].positions.tolist()
    assert {(0, "r"), (1, "r")} == set(out[3])
    assert [0, 0] == [r.indices.numel() for r in out[3].values()]
    assert {} == out[4]


def test_remap_flat_of_nothing():
    """No items: no outputs; items with no elements anywhere: every target, empty."""
    assert [] == remap_flat([])
    out = remap_flat([RemapItem(SWAPPED, (4, 6), torch.tensor([], dtype=torch.int32))])
    assert [(0, "t")] == list(out[0])
    assert torch.int32 == out[0][(0, "t")].indices.dtype
    assert 0 == out[0][(0, "t")].positions.numel()


@pytest.mark.parametrize("indices, message", [
    (torch.tensor([0, 24]), "tensor 'w': indices: expected inside [0, 24), got [0, 24]"),
    (torch.tensor([-1]), "tensor 'w': indices: expected inside [0, 24), got [-1, -1]"),
    (torch.tensor([[0]]), "tensor 'w': indices: expected a 1-D int32 or int64 tensor, "
                          "got 2-D torch.int64"),
])
def test_remap_flat_rejects_what_remap_rejects(indices, message):
    """A bad item among good ones raises ``remap``'s GeometryError with its message."""
    good = RemapItem(ROWS, (4, 6), torch.tensor([3]))
    with pytest.raises(GeometryError) as info:
        remap_flat([good, RemapItem(SWAPPED, (4, 6), indices, tensor="w")])
    assert message == str(info.value)
