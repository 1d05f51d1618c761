"""Hypothesis strategies and a real-``torch.optim.AdamW`` driver for the detector tests.

The workspace's shared strategies (``tests/strategies.py`` at the repository root) are
loaded by path under a private module name, because the ``tests`` folders of the
workspace are not importable packages.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import attrs
import torch
from hypothesis import strategies as st

_SHARED = Path(__file__).resolve().parents[3] / "tests" / "strategies.py"
_NAME = "dte_workspace_strategies"


def _load_shared():
    if _NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(_NAME, _SHARED)
        module = importlib.util.module_from_spec(spec)
        sys.modules[_NAME] = module
        spec.loader.exec_module(module)
    return sys.modules[_NAME]


_shared = _load_shared()
PAYLOAD_DTYPES = _shared.PAYLOAD_DTYPES
adamw_hyper = _shared.adamw_hyper
boundary_floats = _shared.boundary_floats
shapes = _shared.shapes
torch_adamw_impl = _shared.torch_adamw_impl

MAX_WARMUP_STEPS = 2


@st.composite
def gradients(draw, count: int) -> torch.Tensor:
    """Gradients of mixed scales with exact +-0 and, sometimes, NaN or +-inf."""
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    scale = draw(st.sampled_from([0.0, 1e-30, 1e-8, 1e-3, 1.0, 1e4]))
    values = torch.randn(count, generator=gen) * scale
    kind = torch.randint(0, 16, (count,), generator=gen)
    values = torch.where(kind == 0, torch.zeros(()), values)
    values = torch.where(kind == 1, torch.full((), -0.0), values)
    if draw(st.booleans()):
        specials = torch.tensor([float("nan"), float("inf"), -float("inf")])
        pick = specials[torch.randint(0, len(specials), (count,), generator=gen)]
        values = torch.where(kind == 2, pick, values)
    return values


@attrs.frozen
class AdamWCase:
    """One trajectory: masters ``master`` right before the last of ``len(grads)`` steps.

    The steps before the last one only build up the moments (``step``, ``exp_avg``,
    ``exp_avg_sq``); the masters are then set to ``master`` so that the checked step
    starts from boundary-stressing values.
    """

    master: torch.Tensor
    grads: tuple[torch.Tensor, ...]
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    impl: dict
    dtype: torch.dtype

    def optimizer(self, param: torch.nn.Parameter) -> torch.optim.AdamW:
        return torch.optim.AdamW([param], lr=self.lr, weight_decay=self.weight_decay,
                                 betas=self.betas, eps=self.eps, **self.impl)


@st.composite
def adamw_cases(draw, dtypes=PAYLOAD_DTYPES) -> AdamWCase:
    """Boundary masters, gradients, hyper-parameters, implementation and payload dtype."""
    shape = draw(shapes)
    count = 1
    for size in shape:
        count *= size
    steps = draw(st.integers(1, 1 + MAX_WARMUP_STEPS))
    hyper = draw(adamw_hyper)
    return AdamWCase(
        master=draw(boundary_floats(count)).reshape(shape),
        grads=tuple(draw(gradients(count)).reshape(shape) for _ in range(steps)),
        lr=hyper["lr"], weight_decay=hyper["weight_decay"], betas=hyper["betas"],
        eps=hyper["eps"], impl=draw(torch_adamw_impl), dtype=draw(st.sampled_from(dtypes)))


MIDPOINT_COUNT = 1 << 14
"""Elements per midpoint case: about one in 1e4 of them is missed without a guard band."""


def midpoints(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 midpoint between ``values.to(dtype)`` and its neighbour towards +inf
    (exact in fp32 for bf16 and fp16): where the round-to-nearest-even cast flips."""
    low = values.to(dtype)
    high = torch.nextafter(low, torch.full_like(low, float("inf")))
    return (low.float() + high.float()) / 2


@st.composite
def midpoint_cases(draw, count: int = MIDPOINT_COUNT) -> AdamWCase:
    """Dense adversarial cases for the inversion: every master sits on, or within 2 fp32
    ulps of, a rounding midpoint of the payload dtype, under one or two real AdamW steps
    of a log-uniform lr in [1e-7, 1e-3]. Without the guard band about one case in four
    of these misses a change (measured with the ``ci`` profile)."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    weights = torch.randn(count, generator=gen) * draw(st.sampled_from([0.02, 1.0]))
    offsets = torch.randint(-2, 3, (count,), generator=gen, dtype=torch.int32)
    master = (midpoints(weights, dtype).view(torch.int32) + offsets).view(torch.float32)
    scale = draw(st.sampled_from([1e-6, 1e-3, 1.0]))
    steps = draw(st.integers(1, 2))
    return AdamWCase(
        master=master, grads=tuple(torch.randn(count, generator=gen) * scale
                                   for _ in range(steps)),
        lr=10 ** draw(st.floats(-7, -3)), weight_decay=draw(st.sampled_from([0.0, 0.01, 0.1])),
        betas=(draw(st.sampled_from([0.0, 0.9])), draw(st.sampled_from([0.95, 0.999]))),
        eps=1e-8, impl=draw(torch_adamw_impl), dtype=dtype)


@attrs.frozen
class SteppedCase:
    """What the detectors see after the case's last step."""

    old: torch.Tensor
    """The payload before the last step: ``cast(master)``."""
    new: torch.Tensor
    """The payload after it."""
    optimizer: torch.optim.AdamW
    param: torch.nn.Parameter


def run_case(case: AdamWCase, *, device: str = "cpu") -> SteppedCase:
    """Run the warm-up steps, set the masters to ``case.master``, run the checked step."""
    param = torch.nn.Parameter(case.master.to(device, copy=True))
    optimizer = case.optimizer(param)
    for grad in case.grads[:-1]:
        param.grad = grad.to(device, copy=True)
        optimizer.step()
    with torch.no_grad():
        param.copy_(case.master)
    old = param.detach().to(case.dtype).clone()
    param.grad = case.grads[-1].to(device, copy=True)
    optimizer.step()
    return SteppedCase(old, param.detach().to(case.dtype).clone(), optimizer, param)


def width(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size() * 8


def bits_of(values: torch.Tensor) -> list[int]:
    """Bit patterns as Python ints, for readable bitwise equality asserts."""
    ints = {16: torch.int16, 32: torch.int32, 64: torch.int64}[width(values.dtype)]
    return values.reshape(-1).view(ints).tolist()


def record_all(detector, pairs: dict, *, copy: bool) -> None:
    """One trainer step of a ``CastDetector`` over ``name: (master, model)``: the fused
    ``record_and_copy_all``, or ``record_all`` then the copies."""
    if copy:
        detector.record_and_copy_all(pairs)
    else:
        detector.record_all(pairs)
        for master, model in pairs.values():
            model.copy_(master)
