"""The SGLang receiver inside SGLang 0.5.23's own classes on CPU (marker ``sglang``).

Payloads go through the model runner's ``WeightUpdater``, down both of SGLang's update
paths (``update_weights_from_tensor``, and ``update_weights_from_distributed`` from the
received tensor on), into the model's ``load_weights`` that areal-dte's plugin hooks;
after every version the live params must equal, byte for byte, a fresh SGLang model that
``load_weights``-ed the full new weights. sglang is imported only inside fixtures and
helpers, so the default run collects this file, and the sglang stage fails (never
skips) without sglang.
"""

from __future__ import annotations

import multiprocessing

import attrs
import pytest
import torch
from areal_dte.errors import PayloadRejectedError
from areal_dte.sglang_receiver import PAYLOAD_TENSOR, load_payload, payload_tensors
from bitwise import first_difference
from dte_transport import Rejection
from group_worker import finish
from sglang_world import (
    Trainer,
    assert_equals_full_load,
    loaded,
    params,
    run_rank,
    send_distributed,
    send_tensor,
    sglang_model,
    start,
    trajectory,
    weight_updater,
)

pytestmark = pytest.mark.sglang

ANCHOR = 3
"""A full anchor after this many deltas, mid-stream."""
JOIN_SECONDS = 300
"""Each spawned rank imports sglang (about 20 s of CPU) before it starts."""


@attrs.frozen
class Path:
    """One of SGLang's weight-update paths and how it answers."""

    send: object
    ok: tuple[bool, str]
    failed: str
    """What SGLang's answer to a refused payload starts with."""
    after: str = ""
    """What SGLang appends to the reason (its generic words for a failed load; a refused
    payload changes nothing)."""


PATHS = [
    pytest.param(Path(send_tensor, (True, "Success"), "DTE weight update failed: "),
                 id="from-tensor"),
    pytest.param(Path(send_distributed, (True, "Succeeded to update parameter online."),
                      "Failed to update parameter online: ",
                      ". The full weights of the ModelRunner are partially updated. Please "
                      "discard the whole weights."), id="from-distributed"),
]


def _dense():
    from transformers import Qwen3Config

    # vocab 100 pads to 128 rows; tied embeddings, so no lm_head
    return Qwen3Config(vocab_size=100, hidden_size=32, intermediate_size=48,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, tie_word_embeddings=True)


def _moe():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=90, hidden_size=32, moe_intermediate_size=16,
                          num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          tie_word_embeddings=False)


CONFIGS = [pytest.param(_dense, id="qwen3"), pytest.param(_moe, id="qwen3-moe")]


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    """SGLang's process state for TP 1 on CPU, with areal-dte's plugin applied."""
    start(str(tmp_path_factory.mktemp("sglang")))


def _served(hf_config):
    """A served model after its startup load (other weights than the trainer's), the
    weight updater that feeds it, and a trainer."""
    model = loaded(hf_config, Trainer(hf_config, seed=1).weights)
    return model, weight_updater(model), Trainer(hf_config, seed=0)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("make_config", CONFIGS)
def test_versions_equal_a_full_load(runtime, make_config, path):
    """Version 1 full, then deltas of real AdamW steps with a full anchor after every 3:
    after each version the live fused params (qkv_proj, gate_up_proj, w13/w2 experts,
    padded vocab) equal SGLang's own full load of the new weights, bit for bit."""
    hf_config = make_config()
    live, updater, trainer = _served(hf_config)
    numel = sum(w.numel() for w in trainer.weights.values())
    kinds = []
    for version, kind, data in trajectory(trainer, versions=9, anchor=ANCHOR):
        if kind == "delta":  # a real delta: some elements, and sent sparse
            assert 0 < sum(len(c.indices) for c in trainer.changes.values()) < numel // 2
            assert len(data) < len(trainer.full(version)) // 2
        assert path.ok == path.send(updater, data)
        assert_equals_full_load(hf_config, trainer.weights, live)
        kinds.append(kind)
    assert ["full"] + ["delta"] * 3 + ["anchor"] + ["delta"] * 3 + ["anchor"] == kinds


@pytest.mark.parametrize(("make_config", "tp", "ep"), [
    pytest.param(_dense, 2, 1, id="qwen3-tp2"),
    pytest.param(_moe, 2, 2, id="qwen3-moe-tp2-ep2")])
def test_tensor_parallel_ranks_over_gloo(make_config, tp, ep, tmp_path):
    """Two SGLang TP ranks (gloo, spawned processes) each apply the same Hugging Face
    payloads into their own slices (qkv heads, gate/up halves, experts of their EP rank,
    half the padded vocab): every version equals a full load on every rank, and a delta
    onto the wrong base is refused on both with no bit changed."""
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=run_rank, args=(rank, str(tmp_path), make_config()),
                             kwargs={"tp": tp, "ep": ep, "versions": 6, "anchor": 2})
             for rank in range(tp)]
    for process in ranks:
        process.start()
    assert ([], [0] * tp) == finish(ranks, JOIN_SECONDS)
    expected = [f"v{v} {kind} True bitwise equal" for v, kind in enumerate(
        ["full", "delta", "delta", "anchor", "delta", "delta"], start=1)]
    for rank in range(tp):
        *versions, refused = (tmp_path / f"rank{rank}.log").read_text().splitlines()
        assert expected == versions
        assert refused.startswith("False None DTE weight update failed: payload rejected "
                                  "(wrong_base): delta onto version 5, holding 6")


def _corrupt(data: bytes) -> bytes:
    flipped = bytearray(data)
    flipped[-1] ^= 0x01
    return bytes(flipped)


REFUSALS = [
    pytest.param(lambda t: t.delta(base=1, version=3), Rejection.WRONG_BASE,
                 "delta onto version 1, holding 2", id="wrong-base"),
    pytest.param(lambda t: t.delta(base=2, version=3, stream_id="other"),
                 Rejection.WRONG_STREAM, "delta of stream 'other', holding 'run'",
                 id="other-stream"),
    pytest.param(lambda t: _corrupt(t.delta(base=2, version=3)), Rejection.BAD_PAYLOAD,
                 "body_digest: expected", id="corrupted"),
    pytest.param(lambda t: t.delta(base=2, version=3)[:-8], Rejection.BAD_PAYLOAD,
                 "payload size: expected", id="truncated"),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("make_config", CONFIGS)
@pytest.mark.parametrize(("refused", "rejection", "detail"), REFUSALS)
def test_refused_payload_changes_no_bit(runtime, make_config, path, refused, rejection,
                                        detail):
    """A delta onto the wrong base, from another stream, corrupted or truncated: SGLang
    answers ``success=False`` with the reason (the scheduler carries on), every param
    keeps its bits, ``load_payload`` raises ``PayloadRejectedError``, and the right delta
    still applies afterwards."""
    hf_config = make_config()
    live, updater, trainer = _served(hf_config)
    assert path.ok == path.send(updater, trainer.full(1))
    trainer.step()
    assert path.ok == path.send(updater, trainer.delta(base=1, version=2))
    before = {name: t.clone() for name, t in params(live).items()}
    trainer.step()
    data = refused(trainer)
    success, message = path.send(updater, data)
    assert not success
    assert message.startswith(f"{path.failed}payload rejected ({rejection.value}): {detail}")
    assert message.endswith(f"; holding version 2{path.after}")
    with pytest.raises(PayloadRejectedError) as info:
        load_payload(live, payload_tensors(data))
    assert (rejection, 2) == (info.value.ack.rejection, info.value.ack.version)
    assert first_difference(before, params(live)) is None
    assert path.ok == path.send(updater, trainer.delta(base=2, version=3))
    assert_equals_full_load(hf_config, trainer.weights, live)


def test_ordinary_tensors_still_load_through_sglang(runtime):
    """The hook leaves every other weight update to SGLang's own loader: one Hugging Face
    tensor sent as usual lands in its fused param."""
    hf_config = _dense()
    live, updater, trainer = _served(hf_config)
    name = "model.layers.0.self_attn.k_proj.weight"
    assert (True, "Success") == updater.update_weights_from_tensor(
        [(name, trainer.weights[name])])
    qkv = params(live)["model.layers.0.self_attn.qkv_proj.weight"]
    assert torch.equal(trainer.weights[name].view(torch.int16),
                       qkv[32:48].view(torch.int16))


def test_payload_tensor_of_another_dtype_is_refused(runtime):
    """A tensor under the payload's name that is no uint8 bytes is refused, nothing
    written."""
    live, updater, _ = _served(_dense())
    before = {name: t.clone() for name, t in params(live).items()}
    success, message = updater.update_weights_from_tensor([(PAYLOAD_TENSOR, torch.zeros(4))])
    assert (False, "DTE weight update failed: payload rejected (bad_payload): expected one "
            "uint8 tensor 'dte.payload', got [('dte.payload', (4,), torch.float32)]; "
            "holding version None") == (success, message)
    assert first_difference(before, params(live)) is None


def test_unsupported_model_fails_the_request(runtime):
    """A MoE model with dense layers, which the SGLang layout does not describe, fails
    the update with the reason; the server would carry on."""
    hf_config = _moe()
    hf_config.mlp_only_layers = [1]
    hf_config.intermediate_size = 24
    success, message = send_tensor(weight_updater(sglang_model(hf_config)), b"unused")
    assert (False, "DTE weight update failed: mlp_only_layers, decoder_sparse_step: expected "
            "[] and 1 (every layer MoE), got [1], 1") == (success, message)
