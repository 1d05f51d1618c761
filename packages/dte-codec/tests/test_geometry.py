"""Boxes, pieces, shards and plans: the canonical-space geometry, on hand-checked cases."""

from __future__ import annotations

import pytest
import torch
from dte_codec.errors import CodecError, GeometryError
from dte_codec.geometry import Box, Piece, Shard, TensorSpec, Transfer, materialize, plan

BF16 = torch.bfloat16


def _shard(rank: int, tensors: dict[str, tuple[int, ...]], pieces: list[Piece]) -> Shard:
    return Shard(rank=rank, tensors={n: TensorSpec(s, BF16) for n, s in tensors.items()},
                 pieces=pieces)


def _rows_piece(tensor: str, local_row: int, canonical: str, row: int, count: int, width: int,
                *, primary: bool = True) -> Piece:
    return Piece(tensor=tensor, local=Box((local_row, 0), (count, width)), canonical=canonical,
                 region=Box((row, 0), (count, width)), primary=primary)


def test_geometry_error_is_codec_and_value_error():
    """``GeometryError`` is a ``CodecError`` and a ``ValueError`` with a located message."""
    exc = GeometryError("shape", tensor="w", expected=(2, 3), got=(3, 2))
    assert isinstance(exc, CodecError) and isinstance(exc, ValueError)
    assert "tensor 'w': shape: expected (2, 3), got (3, 2)" == str(exc)


def test_box_properties():
    """A box knows its stop, element count, squeezed shape and slices."""
    box = Box((1, 0, 2), (3, 1, 4))
    assert ((4, 1, 6), 12, (3, 4)) == (box.stop, box.numel, box.squeezed)
    assert (slice(1, 4), slice(0, 1), slice(2, 6)) == box.slices()
    assert Box((0, 0), (5, 7)) == Box.whole((5, 7))


def test_box_intersection():
    """Overlapping boxes intersect in their common box; disjoint ones in an empty box."""
    a, b = Box((0, 2), (4, 4)), Box((3, 0), (5, 3))
    assert Box((3, 2), (1, 1)) == a.intersect(b)
    assert 0 == a.intersect(Box((4, 0), (2, 6))).numel


def test_box_inside():
    """``inside`` needs the same rank and a stop within the shape."""
    box = Box((1, 1), (2, 2))
    assert (True, False, False) == (box.inside((3, 3)), box.inside((3, 2)), box.inside((9,)))


def test_box_rejects_mismatched_lengths():
    """A box with start and size of different lengths is rejected with both in the message."""
    with pytest.raises(GeometryError) as info:
        Box((0,), (1, 2))
    assert "box: expected start and size of equal length, >= 0, got start (0,), size (1, 2)" \
        == str(info.value)


def test_piece_rejects_differently_shaped_boxes():
    """A piece whose boxes differ beyond size-1 dimensions is rejected, naming both."""
    with pytest.raises(GeometryError) as info:
        Piece(tensor="w13", local=Box((0, 0, 0), (1, 2, 4)), canonical="gate",
              region=Box((0, 0), (4, 2)))
    assert ("tensor 'w13': piece: expected a non-empty box shaped like 'gate' "
            "Box(start=(0, 0), size=(4, 2)), got Box(start=(0, 0, 0), size=(1, 2, 4))"
            ) == str(info.value)


def test_piece_maps_sub_boxes_across_ranks_of_tensor():
    """A sub-box of a 2-D region maps into the 3-D local box dimension by dimension."""
    piece = Piece(tensor="w13", local=Box((3, 4, 0), (1, 4, 6)), canonical="up",
                  region=Box((8, 0), (4, 6)))
    assert Box((3, 5, 2), (1, 2, 3)) == piece.to_local(Box((9, 2), (2, 3)))


def test_shard_rejects_piece_outside_its_tensor():
    """A piece reaching past its local tensor is rejected with the tensor's shape."""
    with pytest.raises(GeometryError) as info:
        _shard(0, {"w": (2, 4)}, [_rows_piece("w", 1, "c", 0, 2, 4)])
    assert ("tensor 'w': piece: expected a box inside (2, 4), "
            "got Box(start=(1, 0), size=(2, 4))") == str(info.value)


def test_check_tensors_names_the_mismatch():
    """``check_tensors`` reports a wrong shape, then a wrong dtype, then wrong names."""
    shard = _shard(0, {"w": (2, 4)}, [])
    with pytest.raises(GeometryError) as info:
        shard.check_tensors({"w": torch.zeros(4, 2, dtype=BF16)})
    assert "tensor 'w': shape: expected (2, 4), got (4, 2)" == str(info.value)
    with pytest.raises(GeometryError) as info:
        shard.check_tensors({"w": torch.zeros(2, 4)})
    assert "tensor 'w': dtype: expected torch.bfloat16, got torch.float32" == str(info.value)
    with pytest.raises(GeometryError) as info:
        shard.check_tensors({"v": torch.zeros(2, 4, dtype=BF16)})
    assert "names: expected ['w'], got ['v']" == str(info.value)
    shard.check_tensors({"w": torch.zeros(2, 4, dtype=BF16)})


def test_materialize_cuts_pieces_and_fills_the_rest():
    """A materialized shard holds its pieces' canonical values; uncovered rows hold fill."""
    shard = _shard(0, {"w": (3, 2)}, [_rows_piece("w", 0, "c", 2, 2, 2)])
    canonical = {"c": torch.arange(8, dtype=BF16).view(4, 2)}
    expected = torch.tensor([[4, 5], [6, 7], [-1, -1]], dtype=BF16)
    assert torch.equal(expected, materialize(shard, canonical, fill=-1)["w"])


def test_plan_splits_rows_over_targets():
    """A whole source tensor is planned onto two targets that each hold half its rows."""
    source = _shard(0, {"s": (4, 2)}, [_rows_piece("s", 0, "c", 0, 4, 2)])
    targets = [_shard(r, {"t": (2, 2)}, [_rows_piece("t", 0, "c", 2 * r, 2, 2)])
               for r in range(2)]
    expected = {"s": (
        Transfer(target_rank=0, target_tensor="t", target_shape=(2, 2),
                 source_box=Box((0, 0), (2, 2)), target_box=Box((0, 0), (2, 2))),
        Transfer(target_rank=1, target_tensor="t", target_shape=(2, 2),
                 source_box=Box((2, 0), (2, 2)), target_box=Box((0, 0), (2, 2))))}
    assert expected == plan(source, targets)


def test_plan_sends_only_primary_pieces_and_reaches_every_replica():
    """A non-primary source piece sends nothing; a replicated target region is reached on
    every target rank that holds it."""
    source = _shard(0, {"a": (2, 2), "b": (2, 2)},
                    [_rows_piece("a", 0, "c", 0, 2, 2),
                     _rows_piece("b", 0, "c", 0, 2, 2, primary=False)])
    targets = [_shard(r, {"t": (1, 2)}, [_rows_piece("t", 0, "c", 1, 1, 2)]) for r in range(3)]
    planned = plan(source, targets)
    assert [0, 1, 2] == [t.target_rank for t in planned["a"]]
    assert {Box((1, 0), (1, 2))} == {t.source_box for t in planned["a"]}
    assert () == planned["b"]
