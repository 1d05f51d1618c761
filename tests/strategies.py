"""Shared Hypothesis strategies: shapes, bit patterns that stress rounding, AdamW settings."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

PAYLOAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

shapes = st.one_of(
    st.just(()),
    st.lists(st.integers(0, 40), min_size=1, max_size=3).map(tuple),
)


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


@st.composite
def boundary_floats(draw, count: int) -> torch.Tensor:
    """fp32 values of which many sit at or next to a bf16 or fp16 rounding boundary.

    A rounding boundary of a 16-bit float is the midpoint between two neighbours; in fp32
    bits it is a 16-bit value shifted left with bit 15 set (bf16) and similar for fp16
    through its own grid. Offsets of a few fp32 ulps put values on both sides of it.
    Special values (NaN, +-inf, +-0, subnormals) are mixed in.
    """
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    scale = draw(st.sampled_from([1e-3, 2e-2, 1.0, 60000.0]))
    values = torch.randn(count, generator=gen) * scale
    kind = torch.randint(0, 10, (count,), generator=gen)
    bits = values.view(torch.int32)
    offsets = torch.randint(-3, 4, (count,), generator=gen, dtype=torch.int32)
    bf16_boundary = (bits & ~0xFFFF) | 0x8000
    bits = torch.where(kind < 4, bf16_boundary + offsets, bits)
    values = bits.view(torch.float32).clone()
    half = values.to(torch.float16).to(torch.float32)
    next_half = torch.nextafter(values.to(torch.float16), torch.tensor(float("inf"),
                                dtype=torch.float16)).to(torch.float32)
    fp16_boundary = (half + next_half) / 2
    values = torch.where(kind == 4, fp16_boundary, values)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40,
                             -1e-45, 3.4e38])
    pick = specials[torch.randint(0, len(specials), (count,), generator=gen)]
    special_rate = draw(st.sampled_from([0, 0, 1]))
    return torch.where((kind == 9) & (special_rate > 0), pick, values)


adamw_hyper = st.fixed_dictionaries({
    "lr": st.floats(1e-7, 1e-3),
    "weight_decay": st.one_of(st.just(0.0), st.floats(0.0, 0.1)),
    "betas": st.tuples(st.sampled_from([0.0, 0.5, 0.9]), st.sampled_from([0.9, 0.95, 0.999])),
    "eps": st.sampled_from([1e-8, 1e-6, 1e-12]),
})

torch_adamw_impl = st.sampled_from([{"foreach": False}, {"foreach": True}, {"fused": True}])
