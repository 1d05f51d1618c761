"""Invariant 7: for any trajectory of real AdamW steps, every delta-synced version is
bitwise equal to a full sync of the trainer's weights, for every detector and payload
dtype."""

from __future__ import annotations

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

ACTIONS = ("step", "partial", "skip")
"""Between syncs: a step of every tensor, a step where some tensors have no gradient (the
optimizer leaves them and their step count alone), or no step at all."""


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


def run(trajectory, log=None):
    log = [] if log is None else log
    masters = {f"t{i}": torch.nn.Parameter(v.clone())
               for i, v in enumerate(trajectory["masters"])}
    hyper = trajectory["hyper"]
    optimizer = torch.optim.AdamW(masters.values(), lr=hyper["lr"], betas=hyper["betas"],
                                  eps=hyper["eps"], weight_decay=hyper["weight_decay"],
                                  **trajectory["impl"])
    rollout = {n: torch.zeros(p.shape, dtype=trajectory["dtype"]) for n, p in masters.items()}
    receiver = Receiver(rollout)
    sender = Sender(Loopback(receiver), anchor_interval=trajectory["anchor"])
    actor = TorchActor(masters, optimizer, sender, method=trajectory["method"],
                       dtype=trajectory["dtype"])
    gen = torch.Generator().manual_seed(trajectory["seed"])
    kinds = []
    for version, actions in enumerate(trajectory["syncs"], start=1):
        for action in actions:
            if action == "skip":
                continue
            for i, param in enumerate(masters.values()):
                keep = action == "step" or torch.rand((), generator=gen) < 0.5
                param.grad = (torch.randn(param.shape, generator=gen)
                              * trajectory["grad_scale"]) if keep else None
            actor.step()
        report = actor.sync(version)
        kinds.append(report.kind)
        log.append(f"v{version} {actions}: {report.kind.value} ({report.reason})")
        assert version == receiver.version
        assert_same_bits(full_sync_of(actor.model), rollout)
    return kinds


NEVER_STEPPED_TENSOR = {
    "dtype": torch.bfloat16, "method": Method.ADAMW,
    "masters": [torch.tensor(0.0015), torch.tensor(0.0015)],
    "hyper": {"lr": 1e-3, "weight_decay": 0.0, "betas": (0.0, 0.9), "eps": 1e-8},
    "impl": {"foreach": False}, "anchor": 0, "grad_scale": 1e-6, "seed": 0,
    "syncs": [["partial"], ["partial"]],
}
"""A tensor without gradient in every step so far has no optimizer state at a delta."""


@given(trajectories())
@example(NEVER_STEPPED_TENSOR)
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
