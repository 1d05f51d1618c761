"""TorchActor: detector choice, step accounting and commit behaviour."""

import areal_dte
import pytest
import torch
from areal_dte import Method, TorchActor
from dte_transport import Loopback, Receiver, Sender, SyncKind


def make(method, *, anchor=20, params=None, verify=False):
    torch.manual_seed(0)
    masters = params or {"w": torch.nn.Parameter(torch.randn(32, 16) * 0.02),
                         "g": torch.nn.Parameter(torch.ones(16))}
    optimizer = torch.optim.AdamW(masters.values(), lr=1e-3, weight_decay=0.01)
    receiver = Receiver({n: torch.zeros(p.shape, dtype=torch.bfloat16)
                         for n, p in masters.items()})
    actor = TorchActor(masters, optimizer, Sender(Loopback(receiver), anchor_interval=anchor),
                       method=method, verify=verify)
    return actor, receiver


def train(actor, steps=1, names=None):
    for _ in range(steps):
        for name, param in actor.masters.items():
            param.grad = torch.randn_like(param) if names is None or name in names else None
        actor.step()


def in_sync(actor, receiver):
    return all(torch.equal(actor.model[n].view(torch.int16), t.view(torch.int16))
               for n, t in receiver.weights.items())


@pytest.mark.parametrize("method", list(Method))
def test_one_step_per_sync_is_a_delta(method):
    """Each detector turns one step into a delta that leaves the rollout in sync."""
    actor, receiver = make(method)
    actor.sync(1)
    train(actor)
    report = actor.sync(2)
    assert (SyncKind.DELTA, True) == (report.kind, in_sync(actor, receiver))
    assert 0 < report.changed < 32 * 16 + 16


def test_adamw_step_gap_forces_full():
    """Two AdamW steps between syncs cannot be inverted: the version goes in full."""
    actor, receiver = make(Method.ADAMW)
    actor.sync(1)
    train(actor, steps=2)
    report = actor.sync(2)
    assert (SyncKind.FULL, "step_gap", True) == (report.kind, report.reason,
                                                  in_sync(actor, receiver))
    train(actor)
    assert SyncKind.DELTA == actor.sync(3).kind


@pytest.mark.parametrize("method", [Method.CAST, Method.SNAPSHOT])
def test_several_steps_per_sync_stay_deltas(method):
    """Cast and snapshot detectors cover any number of steps between syncs."""
    actor, receiver = make(method)
    actor.sync(1)
    train(actor, steps=4)
    report = actor.sync(2)
    assert (SyncKind.DELTA, True) == (report.kind, in_sync(actor, receiver))


@pytest.mark.parametrize("method", list(Method))
def test_skipped_step_sends_an_empty_delta(method):
    """No optimizer step between two syncs: a delta with nothing changed."""
    actor, receiver = make(method)
    actor.sync(1)
    train(actor)
    actor.sync(2)
    report = actor.sync(3)
    assert (SyncKind.DELTA, 0, True) == (report.kind, report.changed, in_sync(actor, receiver))


def test_adamw_partial_step_only_touches_stepped_tensors():
    """A tensor without gradient keeps its step count and reports no change."""
    actor, receiver = make(Method.ADAMW)
    actor.sync(1)
    train(actor, names={"w"})
    report = actor.sync(2)
    assert (SyncKind.DELTA, True) == (report.kind, in_sync(actor, receiver))
    train(actor)  # "g" takes its first step, "w" its second: one step each since v2
    assert SyncKind.DELTA == actor.sync(3).kind
    assert in_sync(actor, receiver)


@pytest.mark.parametrize("method", list(Method))
def test_verification_passes_sound_detectors(method):
    """With snapshot verification on, sound detectors' deltas go out as deltas."""
    actor, receiver = make(method, verify=True)
    actor.sync(1)
    kinds = []
    for version in range(2, 5):
        train(actor)
        kinds.append(actor.sync(version).kind)
    assert ([SyncKind.DELTA] * 3, True) == (kinds, in_sync(actor, receiver))


def _drop_first(actor, name):
    """Make the detector miss one element of ``name``: the first changed one."""
    detect = actor._detect

    def missing_one():
        result = dict(detect())
        change = result[name]
        result[name] = type(change)(change.indices[1:], change.base_low[1:],
                                    change.base_high[1:])
        return result
    actor._detect = missing_one


def _shift_bound(actor, name):
    """Make the detector claim a wrong old value for one element of ``name``."""
    detect = actor._detect

    def shifted():
        result = dict(detect())
        change = result[name]
        # Exact sets have low == high == the old value; the sign-flipped pattern is another
        # point of the total order, so claiming it is wrong.
        claim = change.base_low.clone()
        claim[:1] = (claim[:1].view(torch.int16) ^ -0x8000).view(claim.dtype)
        result[name] = type(change)(change.indices, claim, claim)
        return result
    actor._detect = shifted


@pytest.mark.parametrize("breakage", [_drop_first, _shift_bound])
def test_verification_catches_an_unsound_detector(breakage, caplog):
    """A missed element (or wrong old-value bounds) is caught before sending: the version
    goes in full, the error is logged, and the rollout stays exact. Without verification
    the missed element leaves the rollout wrong (wrong bounds need not: the codec may
    send those values raw)."""
    for verify in (True, False):
        actor, receiver = make(Method.SNAPSHOT, verify=verify)
        actor.sync(1)
        train(actor)
        breakage(actor, "w")
        report = actor.sync(2)
        if verify:
            assert (SyncKind.FULL, True) == (report.kind, in_sync(actor, receiver))
            assert report.reason.startswith("snapshot_verification_failed: tensor 'w'")
            assert "snapshot verification failed" in caplog.text
        else:
            expected = (SyncKind.DELTA, breakage is not _drop_first)
            assert expected == (report.kind, in_sync(actor, receiver))


def test_adamw_after_loading_optimizer_state_is_a_delta():
    """An actor built over an optimizer with loaded state (a resumed run) syncs in full,
    then inverts the next single step as a delta."""
    first, _ = make(Method.ADAMW)
    train(first, steps=3)
    actor, receiver = make(Method.ADAMW)
    actor.optimizer.load_state_dict(first.optimizer.state_dict())
    actor.sync(4)
    train(actor)
    report = actor.sync(5)
    assert (SyncKind.DELTA, True) == (report.kind, in_sync(actor, receiver))


def test_public_api():
    """The package root exports exactly its documented names."""
    assert {"Method", "TorchActor"} == set(areal_dte.__all__)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_copy_all_casts_as_copy_does(device):
    """The grouped multi-tensor copy gives ``copy_``'s bits: fp32 -> bf16/fp16 rounding
    (ties, overflow to inf, subnormals, NaN payloads, -0), several shapes and dtypes, one
    pair on another device."""
    from areal_dte.torch_actor import copy_all
    gen = torch.Generator().manual_seed(3)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40,
                            -3e-39, 3.4e38, 65520.0, 1.00390625, 1.01171875, -2.0 ** -133])
    masters = [torch.cat([special, torch.randn(4000, generator=gen) * 10.0 ** k])
               .reshape(-1, 4).to(device) for k in range(-6, 4, 3)]
    masters.append(torch.randn(7, 3, generator=gen).to(device))
    nan_payload = torch.tensor([0x7FC01234, 0xFF800001], dtype=torch.int64).to(torch.int32)
    masters.append(nan_payload.view(torch.float32).to(device))
    dtypes = [torch.bfloat16, torch.bfloat16, torch.float16, torch.bfloat16, torch.float16,
              torch.bfloat16]
    targets = [torch.zeros(m.shape, dtype=d, device=device) for m, d in zip(masters, dtypes)]
    targets[-2] = targets[-2].cpu()  # a pair across devices, where there are two
    expected = [torch.empty_like(t).copy_(m) for t, m in zip(targets, masters)]
    copy_all(targets, masters)
    assert [e.view(torch.int16).tolist() for e in expected] == [
        t.view(torch.int16).tolist() for t in targets]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts compiled CUDA kernels")
@pytest.mark.parametrize("method", [Method.ADAMW, Method.CAST])
def test_first_syncs_compile_no_codec_kernel(method):
    """Built on CUDA, ``TorchActor`` and a ``Receiver`` staging into SGLang TP shards warm
    the codec up: the first full sync and the first deltas compile no codec kernel."""
    from areal_dte.shard_stage import ShardStage
    from dte_codec.geometry import materialize
    from dte_codec.layouts import hf_shard
    from dte_codec.sglang_layout import SGLangLayout, sglang_shard
    from kernel_mode import compiled_codec_kernels, forget_codec_kernels
    from shard_stage_cases import DENSE, canonical_weights

    forget_codec_kernels()
    canonical = canonical_weights(DENSE, seed=1)
    masters = {n: torch.nn.Parameter(t.float().cuda()) for n, t in canonical.items()}
    shard = sglang_shard(DENSE, SGLangLayout(tp=2, vocab_padding=3), rank=1)
    local = {n: t.cuda() for n, t in materialize(shard, canonical).items()}
    receiver = Receiver(local, stage=ShardStage.of(hf_shard(DENSE), shard, local))
    actor = TorchActor(masters, torch.optim.AdamW(masters.values(), lr=1e-2),
                       Sender(Loopback(receiver)), method=method)
    before = compiled_codec_kernels()
    kinds = [actor.sync(1).kind]
    for version in (2, 3):
        train(actor)
        kinds.append(actor.sync(version).kind)
    assert [SyncKind.FULL, SyncKind.DELTA, SyncKind.DELTA] == kinds
    assert before == compiled_codec_kernels()
