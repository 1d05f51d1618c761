"""Read what ``invert_adamw`` needs out of a ``torch.optim`` AdamW instance."""

from __future__ import annotations

import attrs
import torch

from .errors import UnsupportedOptimizerError
from .inversion import AdamWStep


@attrs.frozen
class AdamWState:
    """One parameter's post-step optimizer state."""

    param: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    hyper: AdamWStep


def flush_to_zero() -> bool:
    """Whether CPU float arithmetic on this thread flushes subnormals to zero
    (``torch.set_flush_denormal(True)``), which the inversion's error bound excludes.

    torch has no getter for the setting, so this multiplies the smallest fp32 subnormal by
    one. CUDA kernels do not follow the setting.
    """
    smallest = torch.ones(1, dtype=torch.int32).view(torch.float32)
    return bool((smallest * 1.0 == 0).item())


def torch_adamw_states(optimizer: torch.optim.Optimizer) -> list[AdamWState]:
    """The state of every parameter that has taken at least one step.

    Call it right after ``optimizer.step()`` and before any lr scheduler step, so that
    each group's ``lr`` is the one the step used.

    Raises:
        UnsupportedOptimizerError: not a decoupled-decay Adam, or AMSGrad is on.
    """
    decoupled = isinstance(optimizer, torch.optim.AdamW)
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        raise UnsupportedOptimizerError("type", type(optimizer).__name__, "AdamW")
    stepped = []
    for group in optimizer.param_groups:
        if group.get("amsgrad"):
            raise UnsupportedOptimizerError("amsgrad", True, False)
        if not (decoupled or group.get("decoupled_weight_decay") or group["weight_decay"] == 0):
            raise UnsupportedOptimizerError("weight decay", "coupled (L2)", "decoupled")
        stepped.extend((group, param, optimizer.state[param]) for param in group["params"]
                       if optimizer.state.get(param))
    steps = _read_steps([state["step"] for _, _, state in stepped])
    states = []
    hypers: dict[tuple[int, int], AdamWStep] = {}
    for (group, param, state), step in zip(stepped, steps):
        # one object per group and step: built and validated once, and what the
        # inversion's configurations then tell apart by identity
        hyper = hypers.get((id(group), step))
        if hyper is None:
            beta1, beta2 = (float(b) for b in group["betas"])
            hyper = hypers[id(group), step] = AdamWStep(
                lr=float(group["lr"]), weight_decay=float(group["weight_decay"]),
                beta1=beta1, beta2=beta2, eps=float(group["eps"]), step=step)
        states.append(AdamWState(param, state["exp_avg"], state["exp_avg_sq"], hyper))
    return states


def _read_steps(steps: list) -> list[int]:
    """Every step count as an int. Fused and capturable AdamW keep them on the device:
    those are read with one stack and one transfer per device and dtype, not one host
    synchronisation (or one cast) each; a float step count is an exact integer."""
    out = [s if not isinstance(s, torch.Tensor) else None for s in steps]
    by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for k, s in enumerate(steps):
        if isinstance(s, torch.Tensor):
            by_kind.setdefault((s.device, s.dtype), []).append(k)
    for positions in by_kind.values():
        values = torch.stack([steps[k].reshape(()) for k in positions]).tolist()
        for k, value in zip(positions, values):
            out[k] = value
    return [int(s) for s in out]
