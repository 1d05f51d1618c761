"""torch_adamw_states: reading what the inversion needs out of a torch.optim optimizer."""

from __future__ import annotations

import pytest
import torch

from dte_detector import AdamWStep, DetectorError, torch_adamw_states
from dte_detector.errors import UnsupportedOptimizerError
from dte_detector.torch_adamw import flush_to_zero


def _stepped(optimizer_type, params, steps: int = 1, **kwargs) -> torch.optim.Optimizer:
    optimizer = optimizer_type(params, **kwargs)
    for _ in range(steps):
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = torch.ones_like(param)
        optimizer.step()
    return optimizer


@pytest.mark.parametrize("impl", [{"foreach": False}, {"foreach": True}, {"fused": True}])
def test_reads_the_hyper_parameters_and_step(impl):
    """Each parameter comes with its group's lr, betas, eps, weight decay and its own step
    count, and the optimizer's own moment tensors."""
    first, second = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    optimizer = _stepped(torch.optim.AdamW, [
        {"params": [first]},
        {"params": [second], "lr": 3e-6, "weight_decay": 0.0, "betas": (0.5, 0.95),
         "eps": 1e-12},
    ], steps=2, lr=1e-5, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8, **impl)
    states = torch_adamw_states(optimizer)
    assert [first, second] == [state.param for state in states]
    assert [
        AdamWStep(lr=1e-5, weight_decay=0.1, beta1=0.9, beta2=0.999, eps=1e-8, step=2),
        AdamWStep(lr=3e-6, weight_decay=0.0, beta1=0.5, beta2=0.95, eps=1e-12, step=2),
    ] == [state.hyper for state in states]
    assert optimizer.state[first]["exp_avg"] is states[0].exp_avg
    assert optimizer.state[second]["exp_avg_sq"] is states[1].exp_avg_sq


def test_parameters_of_one_group_and_step_share_one_step_object():
    """One ``AdamWStep`` per group and step count (what the inversion's configurations
    tell apart by identity); a parameter that skipped a step, or another group with the
    same settings, gets its own, equal or not."""
    a, b, skipped = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    other = torch.nn.Parameter(torch.zeros(2))
    optimizer = _stepped(torch.optim.AdamW, [{"params": [a, b, skipped]}, {"params": [other]}],
                         lr=1e-5)
    for param in (a, b, other):
        param.grad = torch.ones_like(param)
    skipped.grad = None
    optimizer.step()
    first, second, third, fourth = (s.hyper for s in torch_adamw_states(optimizer))
    assert first is second
    assert (2, 1, 2) == (first.step, third.step, fourth.step)
    assert first is not fourth and first == fourth


def test_skips_parameters_that_never_stepped():
    """A parameter without gradient has no state yet and is left out."""
    used, unused = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([used, unused], lr=1e-3)
    used.grad = torch.ones(2)
    optimizer.step()
    assert [used] == [state.param for state in torch_adamw_states(optimizer)]


def test_reads_the_lr_of_the_step_before_the_scheduler_moves_it():
    """Called between optimizer.step() and scheduler.step(), the lr is the step's."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    param.grad = torch.ones(1)
    optimizer.step()
    assert 1e-4 == torch_adamw_states(optimizer)[0].hyper.lr
    scheduler.step()
    assert 5e-5 == torch_adamw_states(optimizer)[0].hyper.lr


def test_accepts_adam_with_decoupled_decay_or_no_decay():
    """Adam(decoupled_weight_decay=True) is AdamW; Adam without weight decay is too."""
    decoupled = _stepped(torch.optim.Adam, [torch.nn.Parameter(torch.zeros(1))], lr=1e-3,
                         weight_decay=0.01, decoupled_weight_decay=True)
    plain = _stepped(torch.optim.Adam, [torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    assert 0.01 == torch_adamw_states(decoupled)[0].hyper.weight_decay
    assert 0.0 == torch_adamw_states(plain)[0].hyper.weight_decay


@pytest.mark.parametrize(("make", "field", "message"), [
    (lambda p: torch.optim.AdamW([p], amsgrad=True), "amsgrad",
     "optimizer amsgrad: expected False, got True"),
    (lambda p: torch.optim.Adam([p], weight_decay=0.01), "weight decay",
     "optimizer weight decay: expected decoupled, got 'coupled (L2)'"),
    (lambda p: torch.optim.SGD([p], lr=0.1), "type",
     "optimizer type: expected AdamW, got 'SGD'"),
])
def test_rejects_optimizers_it_cannot_invert(make, field, message):
    """AMSGrad, Adam with coupled L2 decay and non-Adam optimizers raise
    UnsupportedOptimizerError naming the field, the expectation and what was found."""
    with pytest.raises(UnsupportedOptimizerError) as info:
        torch_adamw_states(make(torch.nn.Parameter(torch.zeros(1))))
    assert message == str(info.value)
    assert field == info.value.field
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, DetectorError)


def test_flush_to_zero_follows_the_setting():
    """The probe reports ``torch.set_flush_denormal`` as it is on this thread."""
    assert torch.set_flush_denormal(True), "this CPU cannot flush subnormals"
    try:
        on = flush_to_zero()
    finally:
        torch.set_flush_denormal(False)
    assert (True, False) == (on, flush_to_zero())
