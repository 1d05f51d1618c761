"""ShardStage's routed deltas against their reference, bit for bit, on SGLang ranks fed
by Hugging Face- and Megatron-layout senders (``dte_codec.routes``: every sparse entry
routed, gathered and scattered by the kernels; reference ``remap_all`` per target).
Full versions copied are ``test_shard_stage_copies.py``'s, deltas decoded with their
checks queued ``test_shard_stage_queued.py``'s; all three take their cases, receiver pairs
and deltas from ``shard_stage_cases``.

On a CUDA device the kernels run there; on the CPU under Triton's interpreter
(``kernel_mode``).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from kernel_mode import CUDA, DEVICE, kernels, needs_triton
from plan_strategies import BACK, PINNED, cases, shards
from areal_dte.shard_stage import ShardStage
from bitwise import first_difference
from dte_codec import decode, encode_delta
from dte_codec.decode import decode_batched
from dte_codec.payload import Flat
from dte_codec.geometry import Piece, Shard, TensorSpec, materialize
from dte_codec.region import Box
from dte_codec import route_kernel, routes
from dte_codec.routes import StagedRoutes
from dte_codec.sglang_layout import SGLangLayout, sglang_shard
from dte_detector import diff
from dte_transport import Receiver, Rejection
from shard_stage_cases import (CASES, DENSE, IDS, PADDING, canonical_weights, delta_frame, on_cpu,
                               receiver_pair, source_shard, stepped)

pytestmark = needs_triton

@pytest.mark.parametrize(("config", "layout", "kind"), CASES, ids=IDS)
@pytest.mark.parametrize(("rate", "narrow"), [(0.02, 2**31), (0.4, 2**31), (0.4, 0)],
                         ids=["sparse", "dense", "dense-64-bit-coordinates"])
def test_routed_delta_equals_the_reference(config, layout, kind, rate, narrow, monkeypatch):
    """Every rank's tensors after a routed delta equal the reference's bit for bit, and
    the routed path staged every sparse entry (no silent fallback); with 32- and with
    64-bit coordinates."""
    monkeypatch.setattr(routes, "_NARROW", narrow)
    source = source_shard(config, kind)
    old = canonical_weights(config, 0)
    data = delta_frame(source, old, stepped(old, 1, rate))
    for rank in range(layout.tp):
        reference, routed = receiver_pair(source, sglang_shard(config, layout, rank=rank), old)
        assert reference.receive(data).accepted
        with kernels():
            staged = routed.stage(routed.weights, decode(data, device=DEVICE)).entries
            assert [StagedRoutes] == [type(s) for s in staged if not hasattr(s, "where")]
            assert routed.receive(data).accepted
        assert first_difference(reference.weights, on_cpu(routed.weights)) is None


def test_delta_decoded_in_one_body_is_routed_from_it(monkeypatch):
    """A delta decoded in one body (``decode_batched``: ``Payload.flat``) is routed from
    the body itself: one routed write, no per-entry value section ever made, and the rank
    ends bit for bit as the reference's."""
    config, layout, kind = CASES[3]
    source = source_shard(config, kind)
    old = canonical_weights(config, 0)
    data = delta_frame(source, old, stepped(old, 1, 0.02))
    reference, routed = receiver_pair(source, sglang_shard(config, layout, rank=1), old)
    assert reference.receive(data).accepted

    def made(self):
        raise AssertionError("per-entry value sections made")

    monkeypatch.setattr(Flat, "entry_values", made)
    with kernels():
        payload = decode_batched(data, device=DEVICE)
        prepared = routed.stage(routed.weights, payload)
        assert [StagedRoutes] == [type(s) for s in prepared.entries]
        prepared.write()
    assert first_difference(reference.weights, on_cpu(routed.weights)) is None


def test_stage_built_where_the_kernels_run_has_its_routes_before_the_first_delta(
        monkeypatch):
    """A stage whose local tensors are where the kernels run builds its routes with
    itself (a Qwen3-4B rank's take ~20-40 ms of host work), so the first delta builds
    none, and is routed bit for bit as the reference."""
    config, layout, kind = CASES[3]
    source, shard = source_shard(config, kind), sglang_shard(config, layout, rank=0)
    old = canonical_weights(config, 0)
    data = delta_frame(source, old, stepped(old, 1, 0.02))
    reference, _ = receiver_pair(source, shard, old)
    assert reference.receive(data).accepted
    with kernels():
        local = {n: t.to(DEVICE) for n, t in materialize(shard, old, fill=PADDING).items()}
        routed = Receiver(local, stage=ShardStage.of(source, shard, local))
        routed.version, routed.stream_id = 1, "s"

        def built(*_args, **_kwargs):
            raise AssertionError("routes built in a delta")

        monkeypatch.setattr(routes.Routes, "of", built)
        staged = routed.stage(routed.weights, decode(data, device=DEVICE)).entries
        assert [StagedRoutes] == [type(s) for s in staged if not hasattr(s, "where")]
        assert routed.receive(data).accepted
    assert first_difference(reference.weights, on_cpu(routed.weights)) is None


def test_source_columns_are_shared_by_the_deltas_of_a_stream():
    """The routes' entry columns of a set of source tensors (``route_kernel``'s NUMEL to
    INNER) are made once and shared, read-only, by every delta naming the same tensors
    (a stream's deltas): no copy per delta; another set of names gets its own."""
    config, layout, kind = CASES[3]
    source, shard = source_shard(config, kind), sglang_shard(config, layout, rank=0)
    local = materialize(shard, canonical_weights(config, 0), fill=PADDING)
    stage = ShardStage.of(source, shard, local)
    table = routes.Routes.of(stage.transfers,
                             {n: tuple(t.shape) for n, t in stage.canonical.items()},
                             {n: t.dtype for n, t in stage.canonical.items()}, local,
                             torch.device("cpu"))
    names = tuple(sorted(table.sources))
    columns = table.source_columns(names)
    assert (route_kernel.INNER - route_kernel.NUMEL + 1, len(names)) == columns.shape
    assert columns is table.source_columns(names)
    assert not columns.flags.writeable
    fewer = table.source_columns(names[1:])
    assert columns[:, 1:].tolist() == fewer.tolist()
    # each value in the row the kernels read it from: sizes and counts of the real shapes
    kernel_row = {c: route_kernel.ENTRY_COLUMNS.index(c) - route_kernel.NUMEL
                  for c in ("numel", "middle", "inner")}
    shapes = {n: (1, 1, *stage.canonical[n].shape)[-3:] for n in names}
    assert {len(stage.canonical[n].shape) for n in names} == {1, 2}
    expected = [[math.prod(shapes[n]) for n in names], [shapes[n][1] for n in names],
                [shapes[n][2] for n in names]]
    assert expected == [columns[kernel_row[c]].tolist() for c in ("numel", "middle", "inner")]


@pytest.mark.parametrize("how", ["replaced", "reallocated"])
def test_routes_write_a_replaced_local_tensor_at_its_new_address(how):
    """A local tensor replaced between two deltas (another tensor under its name) or
    re-allocated in place (the same tensor moved to new storage) gets the second delta's
    values, bit for bit as the reference, and the storage it left none: the stage's
    table of local addresses is remade when an address changes."""
    config, layout, kind = CASES[0]
    source = source_shard(config, kind)
    versions = [canonical_weights(config, 0)]
    versions += [stepped(versions[-1], seed, 0.1) for seed in (1, 2)]
    before, after = (materialize(source, v) for v in versions[1:])
    second = encode_delta(after, {n: diff(before[n], after[n]) for n in after},
                          stream_id="s", base_version=2, version=3)
    reference, routed = receiver_pair(source, sglang_shard(config, layout, rank=0), versions[0])
    first = delta_frame(source, versions[0], versions[1])
    name = max(routed.weights, key=lambda n: routed.weights[n].numel())
    with kernels():
        assert routed.receive(first).accepted
        stale = routed.weights[name]
        if how == "replaced":
            routed.weights[name] = stale.clone()
        else:
            tensor, stale = stale, stale.view(stale.shape)  # a view keeps the old storage
            tensor.set_(stale.clone())
        kept = stale.clone()
        assert routed.receive(second).accepted
    for data in (first, second):
        assert reference.receive(data).accepted
    assert first_difference(reference.weights, on_cpu(routed.weights)) is None
    assert torch.equal(kept.view(torch.int16), stale.view(torch.int16))
    assert not torch.equal(kept.view(torch.int16), routed.weights[name].view(torch.int16))


def test_routed_write_failure_restores_the_rank(monkeypatch):
    """A routed write that fails after scattering leaves the rank at its version, bit
    for bit (the undo log is the gather taken before the write)."""
    config, layout = DENSE, SGLangLayout(tp=2)
    source = source_shard(config, "megatron")
    old = canonical_weights(config, 0)
    data = delta_frame(source, old, stepped(old, 1, 0.3))
    original = StagedRoutes.write

    def write(self):
        original(self)
        raise RuntimeError("device lost")

    # built first: on a GPU the receiver's codec warm-up writes through StagedRoutes too
    reference, routed = receiver_pair(source, sglang_shard(config, layout, rank=1), old)
    monkeypatch.setattr(StagedRoutes, "write", write)
    with kernels():
        ack = routed.receive(data)
    assert (False, 1, Rejection.APPLY_FAILED) == (ack.accepted, ack.version, ack.rejection)
    assert first_difference(reference.weights, on_cpu(routed.weights)) is None


def test_unresolvable_residues_are_refused_as_by_the_reference():
    """Residues sent against other base values than the rank holds (+inf everywhere here)
    resolve out of range: the routed receiver gives way to the reference and refuses the
    delta with its error, writing nothing."""
    config, layout = DENSE, SGLangLayout()
    source = source_shard(config, "hf")
    old = canonical_weights(config, 0)
    data = delta_frame(source, old, stepped(old, 1, 0.3))
    held = {n: torch.full_like(t, float("inf")) for n, t in old.items()}
    reference, routed = receiver_pair(source, sglang_shard(config, layout, rank=0), held)
    expected = reference.receive(data)
    with kernels():
        got = routed.receive(data)
    assert (False, Rejection.BAD_PAYLOAD) == (expected.accepted, expected.rejection)
    assert (expected.accepted, expected.rejection, expected.detail) == (
        got.accepted, got.rejection, got.detail)
    assert first_difference(reference.weights, on_cpu(routed.weights)) is None


def _quadrant_shard(replicated: bool) -> tuple[Shard, Shard]:
    """A sender holding ``w`` (12, 16) and ``v`` (64,) whole, and a rank holding ``w`` cut in
    four quadrants (boxes that vary in two dimensions: no lookup) and ``v`` once, or
    twice in one tensor (an element that two pieces hold)."""
    bf16 = torch.bfloat16
    shapes = {"w": (12, 16), "v": (64,)}
    source = Shard(rank=0, tensors={n: TensorSpec(s, bf16) for n, s in shapes.items()},
                   pieces=[Piece(tensor=n, local=Box.whole(s), canonical=n, region=Box.whole(s))
                           for n, s in shapes.items()])
    tensors = {f"a{k}": TensorSpec((6, 8), bf16) for k in range(4)}
    pieces = [Piece(tensor=f"a{2 * r + c}", local=Box((0, 0), (6, 8)), canonical="w",
                    region=Box((6 * r, 8 * c), (6, 8))) for r in range(2) for c in range(2)]
    tensors["b"] = TensorSpec((2, 64), bf16)
    pieces += [Piece(tensor="b", local=Box((row, 0), (1, 64)), canonical="v",
                     region=Box((0,), (64,))) for row in range(2 if replicated else 1)]
    return source, Shard(rank=0, tensors=tensors, pieces=pieces)


@pytest.mark.parametrize("replicated", [False, True], ids=["quadrants", "replicated"])
def test_boxes_without_lookup_and_replicas(replicated):
    """Transfers that cut a tensor in two dimensions are found box by box, bit for bit as
    the reference; an element that two local pieces hold makes the routes give way to
    the reference, which writes both."""
    source, shard = _quadrant_shard(replicated)
    gen = torch.Generator().manual_seed(0)
    old = {n: torch.randn(s.shape, generator=gen).to(s.dtype) for n, s in source.tensors.items()}
    new = stepped(old, 1, 0.1)
    data = encode_delta(new, {n: diff(old[n], new[n]) for n in new}, stream_id="s",
                        base_version=1, version=2)
    reference, routed = receiver_pair(source, shard, old)
    assert reference.receive(data).accepted
    with kernels():
        staged = routed.stage(routed.weights, decode(data, device=DEVICE)).entries
        assert (not replicated) == any(isinstance(s, StagedRoutes) for s in staged)
        assert routed.receive(data).accepted
    assert first_difference(reference.weights, on_cpu(routed.weights)) is None
    assert first_difference(materialize(shard, new, fill=PADDING), on_cpu(routed.weights)) is None


@settings(max_examples=30 if CUDA else 5, deadline=None)
@given(case=cases())
@example(case=PINNED)
@example(case=BACK)
def test_random_plans_route_as_the_reference(case):
    """Property: over random models and layouts (Megatron TP/PP/EP, SGLang TP/EP, padded
    vocabs, Hugging Face; either side sending), a delta from the first source rank lands
    on the first two target ranks bit for bit as the reference puts it."""
    config, source_layout, target_layout, seed, rate = case
    source = shards(config, source_layout)[0]
    old = canonical_weights(config, seed % 1000)
    new = stepped(old, seed % 1000 + 1, rate)
    data = delta_frame(source, old, new)
    for shard in shards(config, target_layout)[:2]:
        reference, routed = receiver_pair(source, shard, old)
        assert reference.receive(data).accepted
        with kernels():
            assert routed.receive(data).accepted
        assert first_difference(reference.weights, on_cpu(routed.weights)) is None
