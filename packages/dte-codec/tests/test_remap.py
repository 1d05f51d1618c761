"""Remapping flat indices along a plan, and copying dense boxes along it."""

from __future__ import annotations

import pytest
import torch
from dte_codec.errors import GeometryError
from dte_codec.geometry import Box, Transfer
from dte_codec.remap import copy_slices, remap


def _transfer(rank: int, name: str, shape: tuple[int, ...], source: Box, target: Box) -> Transfer:
    return Transfer(target_rank=rank, target_tensor=name, target_shape=shape,
                    source_box=source, target_box=target)


# A [4, 6] source whose columns 0..2 go to rank 0's [4, 3] tensor and columns 3..5 to
# rank 1's; rows 1..2 also go, transposed into a [1, 2, 6] slot, to rank 2.
COLUMNS = (
    _transfer(0, "t", (4, 3), Box((0, 0), (4, 3)), Box((0, 0), (4, 3))),
    _transfer(1, "t", (4, 3), Box((0, 3), (4, 3)), Box((0, 0), (4, 3))),
    _transfer(2, "u", (3, 2, 6), Box((1, 0), (2, 6)), Box((2, 0, 0), (1, 2, 6))),
)


def test_remap_hand_checked():
    """Shuffled flat indices land on the right target indices, sorted, with positions into
    the input array; int32 for small targets."""
    indices = torch.tensor([23, 7, 0, 10, 5])  # (3,5) (1,1) (0,0) (1,4) (0,5)
    out = remap(COLUMNS, (4, 6), indices)
    assert [(0, "t"), (1, "t"), (2, "u")] == list(out)
    assert [0, 4] == out[(0, "t")].indices.tolist()
    assert [2, 1] == out[(0, "t")].positions.tolist()
    assert [2, 4, 11] == out[(1, "t")].indices.tolist()
    assert [4, 3, 0] == out[(1, "t")].positions.tolist()
    assert [25, 28] == out[(2, "u")].indices.tolist()
    assert [1, 3] == out[(2, "u")].positions.tolist()
    assert {torch.int32} == {r.indices.dtype for r in out.values()}
    assert {torch.int64} == {r.positions.dtype for r in out.values()}


def test_remap_keeps_empty_targets():
    """Targets that receive nothing still get an (empty) entry, and so does an empty input."""
    out = remap(COLUMNS, (4, 6), torch.tensor([0], dtype=torch.int32))
    assert [1, 0, 0] == [r.indices.numel() for r in out.values()]
    out = remap(COLUMNS, (4, 6), torch.tensor([], dtype=torch.int64))
    assert [0, 0, 0] == [r.indices.numel() for r in out.values()]


def test_remap_uses_int64_for_huge_targets():
    """A target of 2**31 elements or more gets int64 indices."""
    big = _transfer(0, "t", (2**31,), Box((0,), (4,)), Box((2**31 - 4,), (4,)))
    out = remap([big], (4,), torch.tensor([3]))
    assert torch.int64 == out[(0, "t")].indices.dtype
    assert [2**31 - 1] == out[(0, "t")].indices.tolist()


@pytest.mark.parametrize("indices, message", [
    (torch.tensor([0, 24]), "tensor 'w': indices: expected inside [0, 24), got [0, 24]"),
    (torch.tensor([-1]), "tensor 'w': indices: expected inside [0, 24), got [-1, -1]"),
    (torch.tensor([[1]]), ("tensor 'w': indices: expected a 1-D int32 or int64 tensor, "
                           "got 2-D torch.int64")),
    (torch.tensor([1.0]), ("tensor 'w': indices: expected a 1-D int32 or int64 tensor, "
                           "got 1-D torch.float32")),
], ids=["past-end", "negative", "2-D", "float"])
def test_remap_rejects_bad_indices(indices, message):
    """Indices outside the source tensor, or not a 1-D integer tensor, are rejected."""
    with pytest.raises(GeometryError) as info:
        remap(COLUMNS, (4, 6), indices, tensor="w")
    assert message == str(info.value)


def test_remap_rejects_a_plan_for_another_shape():
    """A transfer whose source box lies outside the given source shape is rejected."""
    with pytest.raises(GeometryError) as info:
        remap(COLUMNS, (4, 5), torch.tensor([0]), tensor="w")
    assert ("tensor 'w': source box: expected inside (4, 5), "
            "got Box(start=(0, 3), size=(4, 3))") == str(info.value)


def test_copy_slices_hand_checked():
    """Every box is copied view to view, across tensor ranks; the rest stays untouched."""
    source = torch.arange(24, dtype=torch.bfloat16).view(4, 6)
    targets = {(0, "t"): torch.zeros(4, 3), (1, "t"): torch.zeros(4, 3),
               (2, "u"): torch.full((3, 2, 6), -1.0)}
    copy_slices(COLUMNS, source, targets)
    assert torch.equal(source[:, :3].float(), targets[(0, "t")])
    assert torch.equal(source[:, 3:].float(), targets[(1, "t")])
    assert torch.equal(source[1:3].float(), targets[(2, "u")][2])
    assert torch.equal(torch.full((2, 2, 6), -1.0), targets[(2, "u")][:2])


def test_copy_slices_rejects_missing_or_misshaped_targets():
    """A target missing from the mapping, or of another shape, is rejected by name."""
    source = torch.zeros(4, 6)
    with pytest.raises(GeometryError) as info:
        copy_slices(COLUMNS[:1], source, {}, tensor="w")
    assert "tensor 'w': target tensors: expected rank 0 t, got missing" == str(info.value)
    with pytest.raises(GeometryError) as info:
        copy_slices(COLUMNS[:1], source, {(0, "t"): torch.zeros(3, 4)})
    assert "tensor 'rank 0 t': shape: expected (4, 3), got (3, 4)" == str(info.value)
