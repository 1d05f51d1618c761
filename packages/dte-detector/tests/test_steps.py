"""steps.AdamWSteps: which step each tensor took since the last commit."""

from __future__ import annotations

import pytest
import torch

from dte_detector import steps as steps_module
from dte_detector.errors import StepGapError
from dte_detector.steps import AdamWSteps


def _trainer(count: int = 3):
    params = [torch.nn.Parameter(torch.randn(16)) for _ in range(count)]
    names = {id(p): (f"w{i}",) for i, p in enumerate(params)}
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    return params, optimizer, AdamWSteps(lambda p: names.get(id(p), ()))


def _step(params, optimizer, tracked: AdamWSteps, *, stepping) -> None:
    for i, p in enumerate(params):
        p.grad = torch.randn(16) if i in stepping else None
    optimizer.step()
    tracked.record(optimizer)


def test_commit_recorded_reads_nothing_and_agrees_with_commit(monkeypatch):
    """After recorded steps (one tensor skipped once), ``commit_recorded`` gives each tensor
    the step ``commit`` reads from the optimizer, without reading it: the next steps
    invert with no gap, and a second step before a commit is a gap again."""
    params, optimizer, tracked = _trainer()
    _step(params, optimizer, tracked, stepping={0, 1, 2})
    tracked.commit([optimizer])
    _step(params, optimizer, tracked, stepping={0, 2})

    def unread(_):
        raise AssertionError("commit_recorded read the optimizer")
    with monkeypatch.context() as patch:
        patch.setattr(steps_module, "torch_adamw_states", unread)
        tracked.commit_recorded()
    read = AdamWSteps(tracked._names)
    read.commit([optimizer])
    assert read._synced == tracked._synced == {"w0": 2, "w1": 1, "w2": 2}
    _step(params, optimizer, tracked, stepping={0, 1, 2})
    assert tracked.gap() is None
    _step(params, optimizer, tracked, stepping={1})
    with pytest.raises(StepGapError):
        raise tracked.gap()
