"""Invariant 7: for any trajectory of real AdamW steps, every delta-synced version is
bitwise equal to a full sync of the trainer's weights, for every detector and payload
dtype, also under the loop patterns a single AdamW inversion cannot see (tied names,
checkpoint loads into the masters and the optimizer, hyper-parameters changed between
steps, several steps between syncs)."""

from __future__ import annotations

import copy

import pytest
import torch
from areal_dte import Method, TorchActor
from bitwise import assert_same_bits
from dte_codec import apply_, decode, encode_full
from dte_transport import Loopback, Receiver, Sender, SyncKind
from hypothesis import example, given, note
from hypothesis import strategies as st
from strategies import PAYLOAD_DTYPES, adamw_hyper, boundary_floats, numel, shapes, \
    torch_adamw_impl

ACTIONS = ("step", "partial", "skip", "hyper", "save", "load")
"""Between syncs: a step of every tensor; a step where some tensors have no gradient (the
optimizer leaves them and their step count alone); no step at all; new lr and betas for
the next steps; a checkpoint of masters and optimizer state; that checkpoint loaded back
(``load_state_dict`` of a module over the masters, and of the optimizer)."""
LRS = (0.0, 1e-6, 1e-4, 1e-3)
BETAS = ((0.9, 0.999), (0.8, 0.99), (0.0, 0.9))


@st.composite
def trajectories(draw):
    tensor_shapes = draw(st.lists(shapes, min_size=1, max_size=3))
    return {
        "dtype": draw(st.sampled_from(PAYLOAD_DTYPES)),
        "method": draw(st.sampled_from(list(Method))),
        "masters": [draw(boundary_floats(numel(s))).reshape(s) for s in tensor_shapes],
        "hyper": draw(adamw_hyper),
        "impl": draw(torch_adamw_impl),
        "anchor": draw(st.integers(0, 3)),
        "tied": draw(st.booleans()),
        "grad_scale": draw(st.sampled_from([1e-6, 1e-2, 1.0, 1e3])),
        "seed": draw(st.integers(0, 2**31 - 1)),
        "syncs": draw(st.lists(st.lists(st.sampled_from(ACTIONS), min_size=1, max_size=5),
                               min_size=2, max_size=6)),
    }


def full_sync_of(weights):
    """What a receiver holds after a full sync of ``weights``: the reference."""
    fresh = {name: torch.empty_like(t) for name, t in weights.items()}
    apply_(fresh, decode(encode_full(weights, stream_id="reference", version=0)))
    return fresh


class Loop:
    """The trainer's side of a trajectory: masters (the first one also under a tied
    name), a real AdamW, a ``TorchActor`` and its checkpoints."""

    def __init__(self, trajectory):
        self.params = [torch.nn.Parameter(v.clone()) for v in trajectory["masters"]]
        masters = {f"t{i}": p for i, p in enumerate(self.params)}
        if trajectory.get("tied"):
            masters["t0.tied"] = self.params[0]
        hyper = trajectory["hyper"]
        self.optimizer = torch.optim.AdamW(self.params, lr=hyper["lr"], betas=hyper["betas"],
                                           eps=hyper["eps"], weight_decay=hyper["weight_decay"],
                                           **trajectory["impl"])
        self.rollout = {n: torch.zeros(p.shape, dtype=trajectory["dtype"])
                        for n, p in masters.items()}
        self.receiver = Receiver(self.rollout)
        sender = Sender(Loopback(self.receiver), anchor_interval=trajectory["anchor"])
        self.actor = TorchActor(masters, self.optimizer, sender, method=trajectory["method"],
                                dtype=trajectory["dtype"])
        self.module = torch.nn.ParameterList(self.params)
        self.gen = torch.Generator().manual_seed(trajectory["seed"])
        self.scale = trajectory["grad_scale"]
        self.saved = None

    def act(self, action):
        if action == "hyper":
            lr, betas = (torch.randint(len(c), (), generator=self.gen) for c in (LRS, BETAS))
            self.optimizer.param_groups[0].update(lr=LRS[lr], betas=BETAS[betas])
        elif action == "save":
            self.saved = (copy.deepcopy(self.module.state_dict()),
                          copy.deepcopy(self.optimizer.state_dict()))
        elif action == "load" and self.saved is not None:
            self.module.load_state_dict(self.saved[0])
            self.optimizer.load_state_dict(self.saved[1])
        elif action in ("step", "partial"):
            for param in self.params:
                keep = action == "step" or torch.rand((), generator=self.gen) < 0.5
                param.grad = (torch.randn(param.shape, generator=self.gen)
                              * self.scale) if keep else None
            self.actor.step()


def run(trajectory, log=None):
    log = [] if log is None else log
    loop = Loop(trajectory)
    kinds = []
    for version, actions in enumerate(trajectory["syncs"], start=1):
        for action in actions:
            loop.act(action)
        report = loop.actor.sync(version)
        kinds.append(report.kind)
        log.append(f"v{version} {actions}: {report.kind.value} ({report.reason})")
        assert version == loop.receiver.version
        assert_same_bits(full_sync_of(loop.actor.model), loop.rollout)
        assert_same_bits(full_sync_of({n: p.detach().to(trajectory["dtype"])
                                       for n, p in loop.actor.masters.items()}), loop.rollout)
    return kinds


NEVER_STEPPED_TENSOR = {
    "dtype": torch.bfloat16, "method": Method.ADAMW,
    "masters": [torch.tensor(0.0015), torch.tensor(0.0015)],
    "hyper": {"lr": 1e-3, "weight_decay": 0.0, "betas": (0.0, 0.9), "eps": 1e-8},
    "impl": {"foreach": False}, "anchor": 0, "grad_scale": 1e-6, "seed": 0,
    "syncs": [["partial"], ["partial"]],
}
"""A tensor without gradient in every step so far has no optimizer state at a delta."""

LOOP_PATTERNS = {
    "dtype": torch.bfloat16, "method": Method.ADAMW, "tied": True,
    "masters": [torch.randn(16, 8, generator=torch.Generator().manual_seed(0)) * 0.02,
                torch.randn(8, generator=torch.Generator().manual_seed(1))],
    "hyper": {"lr": 1e-3, "weight_decay": 0.01, "betas": (0.9, 0.999), "eps": 1e-8},
    "impl": {"foreach": True}, "anchor": 0, "grad_scale": 1.0, "seed": 3,
    "syncs": [["step"], ["partial", "hyper", "partial"], ["save", "step"],
              ["step", "load", "step"], ["step"]],
}
"""Tied names, each tensor stepping once per sync with new hyper-parameters in between,
and a checkpoint loaded back (the last two steps see the same step counts)."""


@given(trajectories())
@example(NEVER_STEPPED_TENSOR)
@example(LOOP_PATTERNS)
def test_every_version_equals_a_full_sync(trajectory):
    """Receiver bytes after each sync equal a full sync of the trainer's weights."""
    log = []
    try:
        kinds = run(trajectory, log)
    finally:
        note("\n".join(log))
    assert SyncKind.DELTA not in kinds[:1]


@given(trajectories().filter(lambda t: t["anchor"] > 0))
def test_anchor_bounds_consecutive_deltas(trajectory):
    """No more than ``anchor_interval`` deltas follow each other."""
    kinds = run(trajectory)
    run_length = 0
    for kind in kinds:
        run_length = run_length + 1 if kind == SyncKind.DELTA else 0
        assert run_length <= trajectory["anchor"]


@pytest.mark.parametrize("method", list(Method))
def test_single_steps_sync_as_deltas(method):
    """With one step per sync and no anchor due, every sync after the first is a delta."""
    trajectory = {"dtype": torch.bfloat16, "method": method,
                  "masters": [torch.randn(64, 32) * 0.02, torch.ones(32)],
                  "hyper": {"lr": 1e-4, "weight_decay": 0.01, "betas": (0.9, 0.999),
                            "eps": 1e-8},
                  "impl": {"foreach": True}, "anchor": 0, "grad_scale": 1.0, "seed": 0,
                  "syncs": [["step"]] * 5}
    assert [SyncKind.FULL] + [SyncKind.DELTA] * 4 == run(trajectory)
