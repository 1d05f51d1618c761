"""``box_copy``: cuts of box entries written by the copy kernel, bit for bit as one
``copy_`` per cut; on the CPU under Triton's interpreter (switched on before the kernels
are first imported), on a CUDA device there."""

from __future__ import annotations

import pytest
import torch
from kernel_mode import DEVICE, kernels, needs_triton

from dte_codec.box_copy import CopyPlan, Cut
from dte_codec.fields import WORD_BYTES
from dte_codec.region import Box

pytestmark = needs_triton

# (entry shape, inside start, inside size, local shape, local start, local size)
CUTS = {
    "rows": ((4, 5), (1, 0), (2, 5), (6, 10), (2, 3), (2, 5)),
    "column-to-row": ((4, 5), (0, 2), (4, 1), (3, 8), (1, 4), (1, 4)),
    "3d": ((3, 4, 8), (0, 1, 0), (3, 2, 8), (5, 2, 8), (1, 0, 0), (3, 2, 8)),
    "one": ((3, 3), (2, 1), (1, 1), (2, 2), (1, 0), (1, 1)),
    "whole": ((7, 12), (0, 0), (7, 12), (7, 12), (0, 0), (7, 12)),
}


def _case(names, dtype, offset, device):
    """Per cut an entry's values and a local tensor on ``device`` (a view ``offset``
    items into a larger buffer there, so not word-aligned when ``offset`` is odd),
    filled with random bits."""
    gen = torch.Generator().manual_seed(len(names) + offset)
    cuts, values, weights = [], [], {}
    for k, name in enumerate(names):
        shape, start, size, local_shape, local_start, local_size = CUTS[name]
        numel = torch.Size(local_shape).numel()
        buffer = torch.randint(-2**15, 2**15, (numel + offset,), generator=gen,
                               dtype=torch.int32).to(dtype)
        weights[name] = buffer.to(device)[offset:].view(local_shape)
        values.append(torch.randint(-2**15, 2**15, (torch.Size(shape).numel(),),
                                    generator=gen, dtype=torch.int32).to(dtype).to(device))
        cuts.append(Cut(k, name, Box(start, size), shape, Box(local_start, local_size),
                        local_shape))
    return cuts, values, weights


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
@pytest.mark.parametrize("offset", [0, 1])
def test_copy_equals_copy_per_cut(dtype, offset):
    """Every cut (rows, a strided column into a row, 3-D, one element, a whole tensor),
    word-aligned or not, lands as the reference ``copy_`` puts it, and nothing else
    changes."""
    cuts, device_values, device_weights = _case(list(CUTS), dtype, offset, DEVICE)
    expected = _copied_per_cut(cuts, device_values, device_weights)
    aligned = all(t.data_ptr() % WORD_BYTES == 0
                  for t in [*device_values, *device_weights.values()])
    assert (offset == 0) == aligned  # both the word and the item path run
    plan = CopyPlan.of(cuts, {n: t.element_size() for n, t in device_weights.items()},
                       torch.device(DEVICE), aligned=aligned)
    with kernels():
        plan.write(device_values, device_weights)
    _assert_bits(expected, device_weights)


def test_a_plan_writes_where_its_values_and_tensors_are_now():
    """A plan written again with values and local tensors at other addresses (new
    tensors of the same shapes, as after a reload) writes into those, bit for bit as
    ``copy_`` per cut, and leaves the first ones as they were."""
    cuts, values, weights = _case(list(CUTS), torch.bfloat16, 0, DEVICE)
    plan = CopyPlan.of(cuts, {n: t.element_size() for n, t in weights.items()},
                       torch.device(DEVICE), aligned=True)
    with kernels():
        plan.write(values, weights)
    first = {n: t.cpu().clone() for n, t in weights.items()}
    gen = torch.Generator().manual_seed(7)
    moved_values = [torch.randint(-2**15, 2**15, v.shape, generator=gen, dtype=torch.int32)
                    .to(v.dtype).to(DEVICE) for v in values]
    moved_weights = {n: t.clone() for n, t in weights.items()}
    expected = _copied_per_cut(cuts, moved_values, moved_weights)
    with kernels():
        plan.write(moved_values, moved_weights)
    _assert_bits(expected, moved_weights)
    _assert_bits(first, weights)


def _copied_per_cut(cuts, values, weights):
    """On the CPU, ``weights`` after one ``copy_`` per cut from ``values``."""
    expected = {n: t.cpu().clone() for n, t in weights.items()}
    for cut, v in zip(cuts, values):
        region = expected[cut.tensor][cut.local.slices()]
        region.copy_(v.cpu().view(cut.shape)[cut.inside.slices()].reshape(region.shape))
    return expected


def _assert_bits(expected, weights):
    for name, tensor in expected.items():
        assert torch.equal(tensor.view(torch.uint8),
                           weights[name].cpu().contiguous().view(torch.uint8)), name


def test_four_unmergeable_dimensions_are_left_to_the_reference():
    """A cut with four dimensions that do not merge has no plan (None)."""
    cut = Cut(0, "t", Box((0, 0, 0, 0), (2, 2, 2, 2)), (3, 3, 3, 3),
              Box((0, 0, 0, 0), (2, 2, 2, 2)), (3, 3, 3, 3))
    assert CopyPlan.of([cut], {"t": 2}, torch.device("cpu"), aligned=True) is None
