"""Entries built one at a time (boxes, sparse parts) and several payloads applied as one
version with ``apply_all``."""

import pytest
import torch
from dte_codec import Kind, decode
from dte_codec.apply import apply_all
from dte_codec.errors import EncodeError, EntryError, MismatchError
from dte_codec.parts import assemble, box_part, dense_part, sparse_part
from dte_codec.region import Box


def as_bits(tensor):
    return tensor.reshape(-1).view(torch.int16).tolist()


def full_from_boxes(source, row_splits, *, stream="s", version=1):
    """One full payload per row band of ``source``, as separate senders would send them."""
    payloads, start = [], 0
    for rows in row_splits:
        part = box_part("w", source[start:start + rows], shape=tuple(source.shape),
                        start=(start, 0))
        payloads.append(decode(assemble([part], stream_id=stream, kind=Kind.FULL,
                                        base_version=-1, version=version)))
        start += rows
    return payloads


def test_boxes_from_several_senders_make_a_full_version():
    """Disjoint row bands from three payloads together rebuild the tensor bit for bit."""
    source = torch.randn(10, 6).bfloat16()
    target = {"w": torch.zeros(10, 6, dtype=torch.bfloat16)}
    apply_all(target, full_from_boxes(source, [3, 3, 4]))
    assert as_bits(source) == as_bits(target["w"])


def test_full_version_must_cover_every_element():
    """Boxes that leave rows uncovered are a MismatchError and nothing is written."""
    target = {"w": torch.zeros(10, 6, dtype=torch.bfloat16)}
    with pytest.raises(MismatchError) as info:
        apply_all(target, full_from_boxes(torch.randn(10, 6).bfloat16(), [3, 3]))
    assert "tensor 'w': entries: expected 60 elements covered, got 36" == str(info.value)
    assert [0] * 60 == as_bits(target["w"])


def test_overlapping_boxes_rejected():
    """Two boxes over the same elements are a MismatchError naming both."""
    source = torch.randn(4, 2).bfloat16()
    parts = [box_part("w", source[:3], shape=(4, 2), start=(0, 0)),
             box_part("w", source[2:], shape=(4, 2), start=(2, 0))]
    payload = decode(assemble(parts, stream_id="s", kind=Kind.FULL, base_version=-1, version=1))
    with pytest.raises(MismatchError) as info:
        apply_all({"w": torch.zeros(4, 2, dtype=torch.bfloat16)}, [payload])
    assert ("tensor 'w': entries: expected disjoint regions, got boxes "
            "Box(start=(0, 0), size=(3, 2)) and Box(start=(2, 0), size=(2, 2)) overlap"
            == str(info.value))


def sparse(values_of, indices, *, base, shape=(8,)):
    old = base.reshape(-1)[indices]
    return sparse_part("w", values_of.reshape(-1)[indices], shape=shape, indices=indices,
                       base_low=old, base_high=old)


def test_sparse_parts_of_one_version_apply_together():
    """Two senders' disjoint index sets of one tensor apply as one delta."""
    base = torch.randn(8).bfloat16()
    new = base.clone()
    new[[1, 6]] += 1
    target = {"w": base.clone()}
    payloads = [decode(assemble([sparse(new, torch.tensor([i]), base=base)], stream_id="s",
                                kind=Kind.DELTA, base_version=1, version=2)) for i in (1, 6)]
    apply_all(target, payloads)
    assert as_bits(new) == as_bits(target["w"])


def test_index_sent_twice_rejected():
    """The same index from two payloads is a MismatchError; nothing is written."""
    base = torch.randn(8).bfloat16()
    payloads = [decode(assemble([sparse(base + 1, torch.tensor([3]), base=base)], stream_id="s",
                                kind=Kind.DELTA, base_version=1, version=2)) for _ in range(2)]
    target = {"w": base.clone()}
    with pytest.raises(MismatchError) as info:
        apply_all(target, payloads)
    assert "tensor 'w': entries: expected disjoint regions, got an index sent twice" == str(
        info.value)
    assert as_bits(base) == as_bits(target["w"])


def test_index_inside_a_box_rejected():
    """A sparse index inside a box of the same version is an overlap."""
    base = torch.randn(8).bfloat16()
    parts = [sparse(base + 1, torch.tensor([5]), base=base),
             box_part("w", base[4:6] + 1, shape=(8,), start=(4,))]
    payload = decode(assemble(parts, stream_id="s", kind=Kind.DELTA, base_version=1, version=2))
    with pytest.raises(MismatchError) as info:
        apply_all({"w": base.clone()}, [payload])
    assert ("tensor 'w': entries: expected disjoint regions, got an index inside box "
            "Box(start=(4,), size=(2,))" == str(info.value))


def test_payloads_of_different_versions_rejected():
    """apply_all takes the payloads of exactly one version."""
    source = torch.randn(2).bfloat16()
    payloads = [decode(assemble([dense_part("w", source)], stream_id="s", kind=Kind.FULL,
                                base_version=-1, version=v)) for v in (1, 2)]
    with pytest.raises(MismatchError) as info:
        apply_all({"w": torch.zeros(2, dtype=torch.bfloat16)}, payloads)
    assert str(info.value).startswith("payloads: expected one stream, kind and version, got")


def test_box_outside_shape_rejected_at_encode():
    """A box that does not fit the receiver shape is an EncodeError."""
    with pytest.raises(EncodeError) as info:
        box_part("w", torch.zeros(3, 2), shape=(4, 2), start=(2, 0))
    assert "tensor 'w': box: expected a region inside shape (4, 2), got start (2, 0), size (3, 2)" \
        == str(info.value)


def test_forged_box_rejected_at_decode():
    """A box section pointing outside the tensor is an EntryError."""
    part = box_part("w", torch.zeros(2, 2), shape=(4, 2), start=(0, 0))
    forged = Box((3, 0), (2, 2)).to_tensor()
    data = assemble([type(part)(part.entry, (forged, part.sections[1]))], stream_id="s",
                    kind=Kind.FULL, base_version=-1, version=1)
    with pytest.raises(EntryError) as info:
        decode(data)
    assert ("tensor 'w': box: expected a non-empty box inside shape (4, 2), got start (3, 0), "
            "size (2, 2)" == str(info.value))


def test_zero_dim_tensor_box():
    """A 0-d tensor travels as a box of no dimensions."""
    source = torch.tensor(1.5)
    payload = decode(assemble([box_part("s", source, shape=(), start=())], stream_id="s",
                              kind=Kind.FULL, base_version=-1, version=1))
    target = {"s": torch.tensor(0.0)}
    apply_all(target, [payload])
    assert 1.5 == target["s"].item()


def test_full_payload_of_dense_and_box_entries():
    """A full payload mixing dense entries and boxes (the box sections read together)
    decodes each entry's region and values; a forged box behind valid ones is refused
    naming its own tensor."""
    a, b = torch.arange(6.0).reshape(3, 2), torch.arange(8.0).reshape(4, 2)
    parts = [box_part("a", a[1:], shape=(3, 2), start=(1, 0)), dense_part("d", b),
             box_part("b", b[:1], shape=(4, 2), start=(0, 0)), box_part("z", torch.tensor(2.0),
                                                                    shape=(), start=())]
    payload = decode(assemble(parts, stream_id="s", kind=Kind.FULL, base_version=-1,
                              version=1))
    assert (Box((1, 0), (2, 2)), Box((0, 0), (4, 2)), Box((0, 0), (1, 2)), Box((), ())) == \
        payload.indices
    assert [[2.0, 3.0, 4.0, 5.0], list(range(8)), [0.0, 1.0], [2.0]] == [
        v[0].view(torch.float32).tolist() for v in payload.values]
    forged = type(parts[2])(parts[2].entry, (Box((3, 0), (2, 2)).to_tensor(),
                                             parts[2].sections[1]))
    with pytest.raises(EntryError) as info:
        decode(assemble([parts[0], parts[1], forged], stream_id="s", kind=Kind.FULL,
                        base_version=-1, version=1))
    assert ("tensor 'b': box: expected a non-empty box inside shape (4, 2), got start (3, 0), "
            "size (2, 2)" == str(info.value))
