"""TorchActor under ordinary training-loop patterns that one AdamW inversion cannot see.

Each pattern ends exact (the rollout holds the actor's model copy and the copy is the
cast of the masters), or in a typed refusal before anything is sent, or in a full sync
whose reason names the pattern; never in a delta that leaves the rollout wrong.
"""

import copy

import pytest
import torch
from areal_dte import Method, TorchActor
from areal_dte.errors import UnknownParameterError
from areal_dte.torch_actor import (FLUSH_TO_ZERO, MASTERS_WRITTEN, MODEL_WRITTEN,
                                   OPTIMIZER_LOADED)
from bitwise import assert_same_bits
from dte_detector.errors import PrecisionError
from dte_transport import Loopback, Receiver, Sender, SyncKind

METHODS = list(Method)


def build(method, masters, *, optimizer=None, dtype=torch.bfloat16, verify=False):
    optimizer = optimizer or torch.optim.AdamW(
        list({id(p): p for p in masters.values()}.values()), lr=1e-3, weight_decay=0.01)
    rollout = {n: torch.zeros(p.shape, dtype=dtype) for n, p in masters.items()}
    actor = TorchActor(masters, optimizer, Sender(Loopback(Receiver(rollout)), anchor_interval=0),
                       method=method, dtype=dtype, verify=verify)
    return actor, rollout


def params(*shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes]


def step(actor, grads=None):
    """One step; ``grads`` names the masters that get a gradient (default all)."""
    for name, param in actor.masters.items():
        keep = grads is None or name in grads
        param.grad = torch.randn_like(param) if keep else None
    actor.step()


def assert_exact(actor, rollout):
    """The rollout holds the model copy, and the copy is the cast of the masters."""
    assert_same_bits(actor.model, rollout)
    assert_same_bits({n: p.detach().to(actor.model[n].dtype) for n, p in actor.masters.items()},
                     actor.model)


@pytest.mark.parametrize("method", METHODS)
def test_tied_weights_sync_under_every_name(method):
    """One parameter under two names stays exact under both.

    Reproduction: ``p = Parameter(...)``; ``TorchActor({"embed": p, "lm_head": p},
    AdamW([p]), ...)``; sync, step, sync: ``lm_head`` never got changes under ``adamw``.
    """
    (shared,) = params((24, 8))
    actor, rollout = build(method, {"embed": shared, "lm_head": shared})
    actor.sync(1)
    for version in (2, 3):
        step(actor)
        report = actor.sync(version)
        assert SyncKind.DELTA == report.kind
        assert_exact(actor, rollout)
    assert 0 < report.changed


@pytest.mark.parametrize("method", METHODS)
def test_rollback_to_a_checkpoint(method):
    """Masters and optimizer state restored to an earlier step, one step, a sync.

    Reproduction: sync v1, step, sync v2, save masters and ``optimizer.state_dict()``,
    step, sync v3, restore both (``optimizer.load_state_dict``), step, sync v4: the step
    count equals v3's, so ``adamw`` took the step for a skipped one and sent nothing.
    """
    (w,) = params((32, 16))
    actor, rollout = build(method, {"w": w})
    actor.sync(1)
    step(actor)
    actor.sync(2)
    saved = (w.detach().clone(), copy.deepcopy(actor.optimizer.state_dict()))
    step(actor)
    actor.sync(3)
    with torch.no_grad():
        w.copy_(saved[0])
    actor.optimizer.load_state_dict(saved[1])
    step(actor)
    report = actor.sync(4)
    expected = ((SyncKind.FULL, OPTIMIZER_LOADED) if method == Method.ADAMW
                else (SyncKind.DELTA, "delta"))
    assert expected == (report.kind, report.reason)
    assert_exact(actor, rollout)
    step(actor)
    assert SyncKind.DELTA == actor.sync(5).kind
    assert_exact(actor, rollout)


@pytest.mark.parametrize("method", METHODS)
def test_model_and_optimizer_loaded_after_the_actor_was_built(method):
    """A checkpoint loaded into the masters' module and the optimizer after building the
    actor: the first full version carries the loaded weights, and the deltas follow them.

    Reproduction: ``TorchActor(dict(module.named_parameters()), opt, ...)``, then
    ``module.load_state_dict(ckpt)``, ``opt.load_state_dict(...)``, sync: v1 held the
    weights from before the load.
    """
    module, trained = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)
    trained_opt = torch.optim.AdamW(trained.parameters(), lr=1e-3)
    for _ in range(2):
        for p in trained.parameters():
            p.grad = torch.randn_like(p)
        trained_opt.step()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    actor, rollout = build(method, dict(module.named_parameters()), optimizer=optimizer)
    module.load_state_dict(trained.state_dict())
    optimizer.load_state_dict(trained_opt.state_dict())
    assert SyncKind.FULL == actor.sync(1).kind
    assert_exact(actor, rollout)
    assert_same_bits({"weight": trained.weight.detach().bfloat16()}, {"weight": rollout["weight"]})
    step(actor)
    assert SyncKind.DELTA == actor.sync(2).kind
    assert_exact(actor, rollout)


@pytest.mark.parametrize("change", [{"lr": 0.0}, {"betas": (0.8, 0.999)}])
def test_each_tensor_steps_once_with_other_hyper_parameters(change):
    """Two steps between syncs, each tensor stepping in one of them, the lr or betas
    changed in between: each tensor is inverted with the hyper-parameters of its step.

    Reproduction: ``a`` gets a gradient and ``b`` none, step; ``group["lr"] = 0`` (or
    betas 0.9 -> 0.8); ``b`` gets a gradient and ``a`` none, step; sync: ``a`` was
    inverted with the second step's lr or betas.
    """
    a, b = params((64, 8), (64, 8))
    actor, rollout = build(Method.ADAMW, {"a": a, "b": b})
    actor.sync(1)
    step(actor, grads={"a"})
    actor.optimizer.param_groups[0].update(change)
    step(actor, grads={"b"})
    report = actor.sync(2)
    assert SyncKind.DELTA == report.kind
    assert_exact(actor, rollout)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_masters_are_refused_by_the_inversion(dtype):
    """AdamW directly on bf16 or fp16 parameters: ``adamw`` refuses at construction (its
    guard band bounds fp32 round-off), ``cast`` stays exact.

    Reproduction: ``TorchActor({"w": Parameter(bf16)}, AdamW(...), method=ADAMW)``:
    diverged at the second version.
    """
    (w,) = params((32, 16))
    low = torch.nn.Parameter(w.detach().to(dtype))
    with pytest.raises(PrecisionError) as caught:
        build(Method.ADAMW, {"w": low}, dtype=dtype)
    assert ("tensor 'w': master is " + str(dtype) + ", expected torch.float32; the AdamW "
            "inversion's guard band holds for fp32 masters and moments only (use the cast "
            "or snapshot detector)") == str(caught.value)
    actor, rollout = build(Method.CAST, {"w": low}, dtype=dtype)
    actor.sync(1)
    for version in (2, 3):
        step(actor)
        assert SyncKind.DELTA == actor.sync(version).kind
        assert_exact(actor, rollout)


def frozen_edit(actor):
    with torch.no_grad():
        actor.masters["frozen"].add_(1.0)


def in_place_edit(actor):
    with torch.no_grad():
        actor.masters["w"].mul_(1.5)


def module_load(actor):
    module = torch.nn.ParameterDict({"w": actor.masters["w"]})
    module.load_state_dict({"w": torch.randn(actor.masters["w"].shape)})


@pytest.mark.parametrize("edit", [frozen_edit, in_place_edit, module_load])
@pytest.mark.parametrize("method", METHODS)
def test_masters_written_outside_the_optimizer(method, edit):
    """A master written outside the optimizer (in place under ``no_grad``, a frozen
    parameter edited, ``load_state_dict`` of its module) reaches the rollout: ``adamw``
    sends that version in full with the reason, ``cast`` and ``snapshot`` as a delta.

    Reproduction: step, ``with torch.no_grad(): p.mul_(1.5)``, sync: the inversion of one
    AdamW step cannot see the multiplication.
    """
    w, frozen = params((32, 16), (16,))
    frozen.requires_grad_(False)
    optimizer = torch.optim.AdamW([w], lr=1e-3)
    actor, rollout = build(method, {"w": w, "frozen": frozen}, optimizer=optimizer)
    actor.sync(1)
    step(actor, grads={"w"})
    edit(actor)
    report = actor.sync(2)
    name = "frozen" if edit is frozen_edit else "w"
    expected = ((SyncKind.FULL, f"{MASTERS_WRITTEN}: tensor {name!r}")
                if method == Method.ADAMW else (SyncKind.DELTA, "delta"))
    assert expected == (report.kind, report.reason)
    assert_exact(actor, rollout)
    edit(actor)  # between steps this time
    step(actor, grads={"w"})
    assert expected[0] == actor.sync(3).kind
    assert_exact(actor, rollout)


@pytest.mark.parametrize("verify", [True, False])
def test_writes_through_data_are_caught_only_by_verification(verify):
    """``p.data`` writes bypass the version counter, so ``adamw`` cannot see them (its
    contract says so): without verification the delta leaves the rollout wrong; snapshot
    verification turns it into a full sync with the reason.

    Reproduction: sync, ``p.data.mul_(1.5)``, step, sync.
    """
    (w,) = params((32, 16))
    actor, rollout = build(Method.ADAMW, {"w": w}, verify=verify)
    actor.sync(1)
    w.data.mul_(1.5)
    step(actor)
    report = actor.sync(2)
    if verify:
        assert (SyncKind.FULL, True) == (
            report.kind, report.reason.startswith("snapshot_verification_failed: tensor 'w'"))
        assert_exact(actor, rollout)
    else:
        assert SyncKind.DELTA == report.kind
        assert not torch.equal(actor.model["w"].view(torch.int16), rollout["w"].view(torch.int16))


def test_flush_to_zero_makes_the_version_full():
    """A step taken with ``torch.set_flush_denormal(True)`` is outside the inversion's
    error bound: the version goes in full.

    Reproduction: a negative subnormal master with zero gradient flushes to -0 in the
    weight decay and the inversion reported it unchanged.
    """
    subnormal = torch.tensor([-1e-40, 0.5, -3e-39], dtype=torch.float32)
    w = torch.nn.Parameter(subnormal.clone())
    optimizer = torch.optim.AdamW([w], lr=1e-3, weight_decay=0.1, foreach=False)
    actor, rollout = build(Method.ADAMW, {"w": w}, optimizer=optimizer, dtype=torch.float32)
    actor.sync(1)
    assert torch.set_flush_denormal(True), "this CPU cannot flush subnormals"
    try:
        w.grad = torch.zeros(3)
        actor.step()
    finally:
        torch.set_flush_denormal(False)
    report = actor.sync(2)
    assert (SyncKind.FULL, FLUSH_TO_ZERO) == (report.kind, report.reason)
    assert_exact(actor, rollout)


@pytest.mark.parametrize("method", METHODS)
def test_writing_into_the_model_copy(method):
    """A write into ``actor.model`` (not the masters) makes the next version full, the
    copy re-cast from the masters.

    Reproduction: step, sync, ``actor.model["w"][0] += 1``, sync: ``adamw`` and ``cast``
    sent an empty delta and the rollout kept the old value.
    """
    (w,) = params((32, 16))
    actor, rollout = build(method, {"w": w})
    actor.sync(1)
    step(actor)
    actor.sync(2)
    actor.model["w"][0] += 1
    report = actor.sync(3)
    assert (SyncKind.FULL, f"{MODEL_WRITTEN}: tensor 'w'") == (report.kind, report.reason)
    assert_exact(actor, rollout)


@pytest.mark.parametrize("method", METHODS)
def test_unknown_optimizer_parameter_is_refused(method):
    """A parameter added with ``add_param_group`` that the actor was not given is refused
    with a typed error before anything is stepped or sent.

    Reproduction: ``optimizer.add_param_group({"params": [q]})``, step: a bare
    ``KeyError`` under ``adamw``; ``q`` never synced under the other two.
    """
    (w,) = params((32, 16))
    actor, rollout = build(method, {"w": w})
    actor.sync(1)
    stranger = torch.nn.Parameter(torch.ones(4, 3))
    actor.optimizer.add_param_group({"params": [stranger]})
    before = w.detach().clone()
    stranger.grad = torch.ones(4, 3)
    with pytest.raises(UnknownParameterError) as caught:
        step(actor)
    assert ("the optimizer holds a parameter of shape (4, 3) and dtype torch.float32 that "
            "is not among the actor's masters; pass every optimizer parameter in masters= "
            "(build a new actor after add_param_group)") == str(caught.value)
    assert torch.equal(before, w.detach())
    with pytest.raises(UnknownParameterError):
        actor.sync(2)
    assert 1 == actor.sender.link.receiver.version
