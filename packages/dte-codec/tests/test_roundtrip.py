"""Property: encode -> decode -> apply_ reproduces the sender's tensors bit for bit.

Over shapes (0-d, empty, odd), payload dtypes (bf16, fp16, fp32), bit patterns of every
kind (NaN payloads, +-0, +-inf, subnormals, extremes) and change sets that are exact,
over-reported, bounded by an interval or unbounded.
"""

from __future__ import annotations

import torch
from bitwise import first_difference
from dte_codec import apply_, decode, encode_delta, encode_full
from dte_codec.bits import from_order_keys, order_keys
from dte_codec.values import int_view
from dte_detector import ChangeSet, diff
from dte_detector.changes import unknown_bounds
from hypothesis import example, given, note
from hypothesis import strategies as st
from strategies import PAYLOAD_DTYPES, numel, shapes

BITS = {torch.bfloat16: 16, torch.float16: 16, torch.float32: 32}
SPECIALS = {
    # +inf, -inf, NaN with payload 1, all-ones NaN, quiet NaN, +0, -0, +-min subnormal,
    # max subnormal, max finite
    torch.bfloat16: [0x7F80, 0xFF80, 0x7F81, 0xFFFF, 0x7FC0, 0, 0x8000, 1, 0x8001, 0x7F,
                     0x7F7F],
    torch.float16: [0x7C00, 0xFC00, 0x7C01, 0xFFFF, 0x7E00, 0, 0x8000, 1, 0x8001, 0x3FF,
                    0x7BFF],
    torch.float32: [0x7F800000, 0xFF800000, 0x7F800001, 0xFFFFFFFF, 0x7FC00000, 0,
                    0x80000000, 1, 0x80000001, 0x7FFFFF, 0x7F7FFFFF],
}
MOVES = ("ulps", "mixed", "random")
BOUNDS = ("exact", "interval", "unknown")


def _patterns(keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values of ``dtype`` with the given order keys."""
    bits = BITS[dtype]
    raw = from_order_keys(keys, bits)
    signed = torch.where(raw >= 2 ** (bits - 1), raw - 2**bits, raw)
    return signed.to(int_view(torch.empty(0, dtype=dtype)).dtype).view(dtype)


def _keys(values: torch.Tensor) -> torch.Tensor:
    return order_keys(int_view(values.reshape(-1)), BITS[values.dtype])


tensor_specs = st.tuples(
    st.sampled_from(PAYLOAD_DTYPES), shapes, st.integers(0, 2**31 - 1),
    st.sampled_from([0.0, 0.01, 0.05, 0.3, 1.0]), st.sampled_from(MOVES),
    st.sampled_from(BOUNDS), st.sampled_from([0.0, 0.0, 0.05]))
"""(dtype, shape, seed, change rate, how values move, bounds kind, over-report rate)."""


def _build(spec) -> tuple[torch.Tensor, torch.Tensor, ChangeSet]:
    """Old and new tensors and a sound change set between them, from a spec."""
    dtype, shape, seed, rate, move, bounds, over = spec
    bits, n = BITS[dtype], numel(shape)
    gen = torch.Generator().manual_seed(seed)
    top = 2**bits - 1
    specials = _keys(torch.tensor(SPECIALS[dtype], dtype=torch.int64).to(
        int_view(torch.empty(0, dtype=dtype)).dtype).view(dtype))
    keys = torch.randint(0, 2**bits, (n,), generator=gen)
    special = torch.rand(n, generator=gen) < 0.2
    keys[special] = specials[torch.randint(0, len(specials), (n,), generator=gen)][special]
    changed = torch.rand(n, generator=gen) < rate
    step = torch.randint(1, 4, (n,), generator=gen) * (
        torch.randint(0, 2, (n,), generator=gen) * 2 - 1)
    jump = torch.randint(0, 2**bits, (n,), generator=gen)
    if move == "ulps":
        new_keys = (keys + step).clamp(0, top)
    elif move == "mixed":
        far = torch.rand(n, generator=gen) < 0.1
        new_keys = torch.where(far, jump, (keys + step).clamp(0, top))
    else:
        new_keys = jump
    new_keys = torch.where(changed, new_keys, keys)
    old, new = _patterns(keys, dtype).reshape(shape), _patterns(new_keys, dtype).reshape(shape)
    exact = diff(old, new)
    extra = torch.rand(n, generator=gen) < over
    index = torch.nonzero(extra | (_keys(old) != _keys(new))).view(-1).to(exact.indices.dtype)
    base_keys = _keys(old)[index.long()]
    if bounds == "exact":
        return old, new, ChangeSet.exact(index, old.reshape(-1)[index.long()])
    if bounds == "unknown":
        low, high = unknown_bounds(dtype, index.numel(), torch.device("cpu"))
        return old, new, ChangeSet(index, low, high)
    below = torch.randint(0, 6, (index.numel(),), generator=gen)
    above = torch.randint(0, 6, (index.numel(),), generator=gen)
    low = _patterns((base_keys - below).clamp(0, top), dtype)
    high = _patterns((base_keys + above).clamp(0, top), dtype)
    return old, new, ChangeSet(index, low, high)


def _assert_bits(expected: dict, actual: dict) -> None:
    difference = first_difference(expected, actual)
    assert difference is None, difference


@given(st.lists(tensor_specs, min_size=1, max_size=3))
@example([(torch.bfloat16, (), 1, 1.0, "ulps", "exact", 0.0),
          (torch.float16, (0, 3), 2, 1.0, "random", "unknown", 0.0),
          (torch.float32, (1,), 3, 1.0, "mixed", "interval", 0.05)])
@example([(torch.bfloat16, (40, 40), 4, 0.05, "ulps", "exact", 0.0)])
@example([(torch.float32, (7, 13), 5, 0.3, "mixed", "interval", 0.05)])
def test_delta_then_apply_gives_new_bits(specs):
    """``apply_(old, decode(encode_delta(new, changes)))`` makes ``old`` bitwise ``new``
    for exact, over-reported, interval and unknown bounds."""
    built = [_build(spec) for spec in specs]
    old = {f"t{i}": o for i, (o, _, _) in enumerate(built)}
    new = {f"t{i}": n for i, (_, n, _) in enumerate(built)}
    changes = {f"t{i}": c for i, (_, _, c) in enumerate(built)}
    data = encode_delta(new, changes, stream_id="p", base_version=3, version=4)
    payload = decode(data)
    note(repr([(e.name, e.index_encoding.name, e.value_encoding.name, e.value_width,
                e.value_escapes) for e in payload.header.entries]))
    receiver = {name: t.clone() for name, t in old.items()}
    apply_(receiver, payload)
    _assert_bits(new, receiver)


@given(st.lists(tensor_specs, min_size=1, max_size=3))
@example([(torch.bfloat16, (), 1, 1.0, "random", "exact", 0.0),
          (torch.float32, (0,), 2, 0.0, "random", "exact", 0.0)])
def test_full_then_apply_gives_new_bits(specs):
    """``apply_(anything, decode(encode_full(new)))`` makes the receiver bitwise ``new``,
    and a delta from the old tensors reaches the same bytes."""
    built = [_build(spec) for spec in specs]
    old = {f"t{i}": o for i, (o, _, _) in enumerate(built)}
    new = {f"t{i}": n for i, (_, n, _) in enumerate(built)}
    receiver = {name: torch.full_like(t, float("nan")) for name, t in new.items()}
    apply_(receiver, decode(encode_full(new, stream_id="p", version=4)))
    _assert_bits(new, receiver)
    changes = {f"t{i}": c for i, (_, _, c) in enumerate(built)}
    by_delta = {name: t.clone() for name, t in old.items()}
    apply_(by_delta, decode(encode_delta(new, changes, stream_id="p", base_version=3,
                                         version=4)))
    _assert_bits(receiver, by_delta)
