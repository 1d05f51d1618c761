"""ShardStage: Hugging Face-named (or Megatron-layout) payloads applied into the fused,
sharded tensors of SGLang ranks, checked against ``materialize`` of the new canonical
weights (which reads the layout's pieces, not the stage's plan)."""

from __future__ import annotations

import pytest
import torch
from areal_dte.shard_stage import ShardStage
from bitwise import first_difference
from dte_codec import decode, encode_delta, encode_full
from dte_codec.apply import Staged
from dte_codec.encodings import Kind
from dte_codec.errors import MismatchError
from dte_codec.fit import check_fit
from dte_codec.geometry import Piece, Shard, TensorSpec, materialize
from dte_codec.layouts import ModelConfig, hf_shard
from dte_codec.megatron_layout import MegatronLayout, megatron_shard
from dte_codec.parts import assemble, box_part, sparse_part
from dte_codec.region import Box
from dte_codec.sglang_layout import SGLangLayout, sglang_shard
from dte_detector import diff
from dte_transport import Receiver, Rejection
from hypothesis import given
from hypothesis import strategies as st
from shard_stage_cases import DENSE, MOE, PADDING, canonical_weights, stepped

LAYOUTS = [(DENSE, SGLangLayout()), (DENSE, SGLangLayout(tp=2, vocab_padding=3)),
           (DENSE, SGLangLayout(tp=4)), (MOE, SGLangLayout(tp=2, ep=2)),
           (MOE, SGLangLayout(tp=4, ep=2)), (MOE, SGLangLayout(tp=2))]
IDS = [f"{'moe' if c.is_moe else 'dense'}-tp{l.tp}-ep{l.ep}-pad{l.vocab_padding}"
       for c, l in LAYOUTS]


def _ranks(config: ModelConfig, layout: SGLangLayout, canonical):
    """Each rank's local tensors (a full load of ``canonical``) and its receiver."""
    out = []
    for rank in range(layout.tp):
        shard = sglang_shard(config, layout, rank=rank)
        local = materialize(shard, canonical, fill=PADDING)
        stage = ShardStage.of(hf_shard(config), shard, local)
        out.append((shard, Receiver(local, stage=stage)))
    return out


def _expected(shard, canonical):
    return materialize(shard, canonical, fill=PADDING)


@pytest.mark.parametrize(("config", "layout"), LAYOUTS, ids=IDS)
def test_full_then_deltas_equal_a_full_load(config, layout):
    """A full sync onto unrelated values, then deltas (residues, raw escapes, dense
    entries), leave every rank's fused tensors equal to a full load, padding untouched."""
    weights = canonical_weights(config, 0)
    ranks = _ranks(config, layout, canonical_weights(config, 1))
    full = encode_full(weights, stream_id="s", version=1)
    for shard, receiver in ranks:
        assert receiver.receive(full).accepted
        assert first_difference(_expected(shard, weights), receiver.weights) is None
    for version, rate in ((2, 0.02), (3, 0.3), (4, 1.0)):
        new = stepped(weights, version, rate)
        changes = {name: diff(weights[name], new[name]) for name in new}
        data = encode_delta(new, changes, stream_id="s", base_version=version - 1,
                            version=version)
        weights = new
        for shard, receiver in ranks:
            assert receiver.receive(data).accepted
            assert first_difference(_expected(shard, weights), receiver.weights) is None


@pytest.mark.parametrize(("config", "layout"), [LAYOUTS[1], LAYOUTS[3]], ids=[IDS[1], IDS[3]])
def test_megatron_source_equals_a_full_load(config, layout):
    """A sender in Megatron's layout (fused, query-group-interleaved ``linear_qkv``, fused
    ``linear_fc1``, grouped experts): its full and delta payloads, named by its own
    tensors, land on every SGLang rank as a full load of the same canonical weights."""
    source = megatron_shard(config, MegatronLayout(), rank=0)
    canonical = canonical_weights(config, 0)
    ranks = []
    for rank in range(layout.tp):
        shard = sglang_shard(config, layout, rank=rank)
        local = materialize(shard, canonical_weights(config, 1), fill=PADDING)
        ranks.append((shard, Receiver(local, stage=ShardStage.of(source, shard, local))))
    weights = materialize(source, canonical)
    for shard, receiver in ranks:
        assert receiver.receive(encode_full(weights, stream_id="s", version=1)).accepted
        assert first_difference(_expected(shard, canonical), receiver.weights) is None
    for version, rate in ((2, 0.02), (3, 0.3)):
        canonical = stepped(canonical, version, rate)
        new = materialize(source, canonical)
        data = encode_delta(new, {n: diff(weights[n], new[n]) for n in new}, stream_id="s",
                            base_version=version - 1, version=version)
        weights = new
        for shard, receiver in ranks:
            assert receiver.receive(data).accepted
            assert first_difference(_expected(shard, canonical), receiver.weights) is None


@given(case=st.sampled_from(LAYOUTS), seed=st.integers(0, 2**16), rate=st.floats(0, 0.5))
def test_delta_equals_full_load(case, seed, rate):
    """Property: for any seed and change rate, one delta equals a full load of the new
    weights on every rank."""
    config, layout = case
    old = canonical_weights(config, seed)
    new = stepped(old, seed + 1, rate)
    data = encode_delta(new, {n: diff(old[n], new[n]) for n in new}, stream_id="s",
                        base_version=1, version=2)
    for shard, receiver in _ranks(config, layout, old):
        receiver.version, receiver.stream_id = 1, "s"
        assert receiver.receive(data).accepted
        assert first_difference(_expected(shard, new), receiver.weights) is None


def test_box_entries_cut_across_ranks():
    """Box entries in canonical space (a part of a tensor, as from one of several
    senders) land in every rank that holds part of them, and nowhere else."""
    config, layout = DENSE, SGLangLayout(tp=2)
    old = canonical_weights(config, 0)
    name = "model.layers.1.mlp.up_proj.weight"
    new = dict(old)
    new[name] = old[name].clone()
    new[name][3:6, 2:9] = 1.5  # rows 0-3 are rank 0's, rows 4-7 rank 1's
    part = box_part(name, new[name][3:6, 2:9], shape=(8, 16), start=(3, 2))
    data = assemble([part], stream_id="s", kind=Kind.DELTA, base_version=1, version=2)
    for shard, receiver in _ranks(config, layout, old):
        receiver.version, receiver.stream_id = 1, "s"
        assert receiver.receive(data).accepted
        assert first_difference(_expected(shard, new), receiver.weights) is None


def _rejected(config, layout, data, rejection: Rejection, detail: str) -> None:
    weights = canonical_weights(config, 0)
    for shard, receiver in _ranks(config, layout, weights):
        receiver.version, receiver.stream_id = 1, "s"
        ack = receiver.receive(data)
        assert (False, 1, rejection, detail) == (ack.accepted, ack.version, ack.rejection,
                                                 ack.detail)
        assert first_difference(_expected(shard, weights), receiver.weights) is None


def test_unknown_tensor_is_a_mismatch():
    """A Hugging Face name the model does not have (a tied model's lm_head) is refused
    before anything is written, with the codec's message."""
    data = encode_full({"lm_head.weight": torch.zeros(21, 8, dtype=torch.bfloat16)},
                       stream_id="s", version=2)
    _rejected(MOE, SGLangLayout(tp=2), data, Rejection.MISMATCH,
              "name: expected a tensor of the receiver, got 'lm_head.weight'")


def test_full_payload_must_cover_every_canonical_tensor():
    """A full payload without some tensor is refused on every rank."""
    weights = canonical_weights(DENSE, 0)
    del weights["model.norm.weight"]
    _rejected(DENSE, SGLangLayout(tp=2), encode_full(weights, stream_id="s", version=2),
              Rejection.MISMATCH, "entries: expected every tensor of the receiver, got a "
              "full payload without ['model.norm.weight']")


def test_wrong_shape_is_a_mismatch():
    """A canonical tensor of another shape is refused, naming tensor and shapes."""
    data = encode_full({"model.norm.weight": torch.zeros(17, dtype=torch.bfloat16)},
                       stream_id="s", version=2)
    _rejected(DENSE, SGLangLayout(tp=2), data, Rejection.MISMATCH,
              "tensor 'model.norm.weight': shape: expected (16,), got (17,)")


def test_failed_write_restores_every_rank_tensor(monkeypatch):
    """A write failing after others of the same delta (several fused tensors) restores
    them all: the rank stays at its version, bit for bit."""
    config, layout = DENSE, SGLangLayout(tp=2)
    old = canonical_weights(config, 0)
    new = stepped(old, 1, 0.2)
    data = encode_delta(new, {n: diff(old[n], new[n]) for n in new}, stream_id="s",
                        base_version=1, version=2)
    original, calls = Staged.write, []

    def write(self):
        calls.append(self.name)
        original(self)
        if len(calls) == 5:
            raise RuntimeError("device lost")

    monkeypatch.setattr(Staged, "write", write)
    shard, receiver = _ranks(config, layout, old)[1]
    receiver.version, receiver.stream_id = 1, "s"
    ack = receiver.receive(data)
    assert (False, 1, Rejection.APPLY_FAILED) == (ack.accepted, ack.version, ack.rejection)
    assert first_difference(_expected(shard, old), receiver.weights) is None


def test_stage_checks_the_local_tensors():
    """Local tensors that are not the shard's (here SGLang TP 2 tensors for a TP 1 shard)
    are refused when the stage is built."""
    local = materialize(sglang_shard(DENSE, SGLangLayout(tp=2), rank=0),
                        canonical_weights(DENSE, 0))
    with pytest.raises(ValueError) as info:
        ShardStage.of(hf_shard(DENSE), sglang_shard(DENSE, SGLangLayout(), rank=0), local)
    assert ("tensor 'model.embed_tokens.weight': shape: expected (64, 16), got (32, 16)"
            == str(info.value))


def test_stage_refuses_strided_tensors():
    """Writes go through flat views, so a strided local tensor is refused up front."""
    shard = sglang_shard(DENSE, SGLangLayout(), rank=0)
    local = materialize(shard, canonical_weights(DENSE, 0))
    name = "model.layers.0.self_attn.o_proj.weight"
    local[name] = local[name].t().contiguous().t()
    with pytest.raises(ValueError) as info:
        ShardStage.of(hf_shard(DENSE), shard, local)
    assert f"layout: expected contiguous local tensors, got strided ['{name}']" == str(info.value)


def test_a_delta_into_a_local_tensor_replaced_by_a_strided_one_is_a_mismatch():
    """A local matrix replaced after the stage was built by a column-major one (same
    shape, dtype and values): the reference writes a delta's sparse entries through flat
    views, so the delta is refused with a ``MismatchError`` naming the tensor, and every
    local tensor keeps its values, bit for bit."""
    config, layout = DENSE, SGLangLayout()
    old = canonical_weights(config, 0)
    new = stepped(old, 1, 0.2)
    data = encode_delta(new, {n: diff(old[n], new[n]) for n in new}, stream_id="s",
                        base_version=1, version=2)
    shard, receiver = _ranks(config, layout, old)[0]
    receiver.version, receiver.stream_id = 1, "s"
    name = next(n for n in shard.tensors if "qkv_proj" in n)
    held = receiver.weights[name]
    receiver.weights[name] = torch.empty_strided(held.shape, (1, held.shape[0]),
                                                 dtype=held.dtype).copy_(held)
    with pytest.raises(MismatchError) as info:
        receiver.stage(receiver.weights, decode(data))
    assert f"tensor '{name}': layout: expected a contiguous tensor, got strided" == str(
        info.value)
    ack = receiver.receive(data)
    assert (False, 1, Rejection.MISMATCH) == (ack.accepted, ack.version, ack.rejection)
    assert first_difference(_expected(shard, old), receiver.weights) is None


def test_full_versions_after_one_that_passed_are_still_checked():
    """A stream's full versions are checked once per table and regions; one whose table
    differs in a single tensor's shape, after two that passed, is refused before
    anything is written: the rank stays at its version, bit for bit."""
    shard, receiver = _ranks(DENSE, SGLangLayout(tp=2), canonical_weights(DENSE, 0))[0]
    for version in (1, 2):
        data = encode_full(canonical_weights(DENSE, version), stream_id="s", version=version)
        assert receiver.receive(data).accepted
    wrong = (canonical_weights(DENSE, 3)
             | {"model.norm.weight": torch.zeros(17, dtype=torch.bfloat16)})
    ack = receiver.receive(encode_full(wrong, stream_id="s", version=3))
    assert (False, 2, Rejection.MISMATCH,
            "tensor 'model.norm.weight': shape: expected (16,), got (17,)") == (
        ack.accepted, ack.version, ack.rejection, ack.detail)
    assert first_difference(_expected(shard, canonical_weights(DENSE, 2)), receiver.weights) is None


def test_deltas_are_checked_once_per_table_skeleton(monkeypatch):
    """A stream's deltas are checked against the canonical tensors once per table
    skeleton (the first delta, whose skeleton the others are read through), then not
    again; a delta whose table names another shape is still refused before
    anything is written."""
    from areal_dte import shard_stage
    from dte_codec.table_bytes import _parsed, _skeletons
    _skeletons.clear()
    _parsed.clear()
    calls = []
    monkeypatch.setattr(shard_stage, "check_fit",
                        lambda *args, **kw: calls.append(1) or check_fit(*args, **kw))
    weights = canonical_weights(DENSE, 0)
    shard, receiver = _ranks(DENSE, SGLangLayout(tp=2), weights)[0]
    receiver.version, receiver.stream_id = 1, "s"
    for version in range(2, 7):
        new = stepped(weights, version, 0.3)
        for tensor in new.values():  # every tensor changes: the same table skeleton
            tensor.view(-1).view(torch.int16)[0] += 1
        data = encode_delta(new, {n: diff(weights[n], new[n]) for n in new}, stream_id="s",
                            base_version=version - 1, version=version)
        weights = new
        assert receiver.receive(data).accepted
        assert first_difference(_expected(shard, weights), receiver.weights) is None
    assert 1 == len(calls)
    new = stepped(weights, 7, 0.3)
    changes = {n: diff(weights[n], new[n]) for n in new}
    new["model.norm.weight"] = torch.zeros(17, dtype=torch.bfloat16)
    changes["model.norm.weight"] = diff(torch.ones(17, dtype=torch.bfloat16),
                                        new["model.norm.weight"])
    ack = receiver.receive(encode_delta(new, changes, stream_id="s", base_version=6,
                                        version=7))
    assert (False, 6, Rejection.MISMATCH,
            "tensor 'model.norm.weight': shape: expected (16,), got (17,)") == (
        ack.accepted, ack.version, ack.rejection, ack.detail)
    assert first_difference(_expected(shard, weights), receiver.weights) is None


def test_entries_of_one_tensor_are_checked_for_overlap_every_delta():
    """Deltas whose entries reach one tensor twice (two senders' index sets) are checked
    for overlap every time, though their table skeleton passed before: a delta sending
    one index twice is refused and nothing is written."""
    spec = TensorSpec((8,), torch.bfloat16)
    whole = Box.whole((8,))
    shard = Shard(rank=0, tensors={"w": spec},
                  pieces=[Piece(tensor="w", local=whole, canonical="w", region=whole)])
    base = torch.randn(8).bfloat16()
    local = {"w": base.clone()}
    receiver = Receiver(local, stage=ShardStage.of(shard, shard, local))
    receiver.version, receiver.stream_id = 1, "s"

    def delta(first: int, second: int, version: int):
        old = local["w"].clone()
        new = old + 1
        parts = [sparse_part("w", new[[k]], shape=(8,), indices=torch.tensor([k]),
                             base_low=old[[k]], base_high=old[[k]]) for k in (first, second)]
        return assemble(parts, stream_id="s", kind=Kind.DELTA, base_version=version - 1,
                        version=version)

    for version, (first, second) in enumerate([(1, 6), (2, 5), (0, 7)], start=2):
        assert receiver.receive(delta(first, second, version)).accepted
    held = local["w"].clone()
    ack = receiver.receive(delta(3, 3, 5))
    assert (False, 4, Rejection.MISMATCH,
            "tensor 'w': entries: expected disjoint regions, got an index sent twice") == (
        ack.accepted, ack.version, ack.rejection, ack.detail)
    assert torch.equal(held.view(torch.int16), local["w"].view(torch.int16))
