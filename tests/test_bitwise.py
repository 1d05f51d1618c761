"""The comparison behind every bitwise claim fails on a single differing element."""

import torch
from bitwise import first_difference
from hypothesis import given
from hypothesis import strategies as st


@given(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       st.integers(1, 500), st.data())
def test_one_flipped_bit_is_found(dtype, size, data):
    """Flipping any single bit of any element makes the comparison report a difference."""
    base = torch.randn(size).to(dtype)
    other = base.clone()
    element = data.draw(st.integers(0, size - 1))
    bit = data.draw(st.integers(0, other.element_size() * 8 - 1))
    ints = other.view({2: torch.int16, 4: torch.int32}[other.element_size()])
    ints[element] ^= (1 << bit) if bit < other.element_size() * 8 - 1 else -(1 << bit)
    assert first_difference({"t": base}, {"t": base.clone()}) is None
    assert first_difference({"t": base}, {"t": other}) is not None


def test_signed_zero_and_nan_payloads_differ():
    """-0.0 vs +0.0 and two NaN payloads compare equal as values but not as bits."""
    zeros = torch.tensor([0.0]), torch.tensor([-0.0])
    nans = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32), \
        torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert torch.equal(*zeros)
    assert first_difference({"z": zeros[0]}, {"z": zeros[1]}) is not None
    assert first_difference({"n": nans[0]}, {"n": nans[1]}) is not None
