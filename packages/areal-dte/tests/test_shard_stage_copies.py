"""ShardStage's full versions copied (``dte_codec.box_copy``; reference one ``copy_`` per
box) against their reference, bit for bit, on SGLang ranks fed by Hugging Face- and
Megatron-layout senders (the cases of ``shard_stage_cases``), and local tensors
replaced between versions.

On a CUDA device the kernels run there; on the CPU under Triton's interpreter
(``kernel_mode``).
"""

from __future__ import annotations

import pytest
import torch
from kernel_mode import DEVICE, kernels, needs_triton
from bitwise import first_difference
from dte_codec import box_copy, decode, encode_full
from dte_codec.box_copy import StagedCopies
from dte_codec.geometry import materialize
from dte_codec.sglang_layout import sglang_shard
from shard_stage_cases import (CASES, IDS, canonical_weights, delta_frame, on_cpu, receiver_pair,
                               source_shard, stepped)

pytestmark = needs_triton


@pytest.mark.parametrize(("config", "layout", "kind"), CASES, ids=IDS)
def test_copied_full_equals_the_reference(config, layout, kind):
    """Every rank's tensors after a full version written by the box-copy kernel equal
    the reference's bit for bit (vocab padding untouched), twice in a row (the second
    from the cached plan), and the kernel wrote every box entry."""
    _check_copied(config, layout, kind)


def test_copied_full_in_small_chunks(monkeypatch):
    """Chunks of 5 elements cut rows into several column chunks, as the long rows of a
    large model are, and take one row each: the same bits as the reference."""
    monkeypatch.setattr(box_copy, "_CHUNK", 5)
    _check_copied(*CASES[4])


def _check_copied(config, layout, kind):
    source = source_shard(config, kind)
    for rank in range(layout.tp):
        reference, copied = receiver_pair(source, sglang_shard(config, layout, rank=rank),
                                          canonical_weights(config, 0))
        for version, seed in ((2, 1), (3, 2)):
            data = encode_full(materialize(source, canonical_weights(config, seed)), stream_id="s",
                               version=version)
            assert reference.receive(data).accepted
            with kernels():
                staged = copied.stage(copied.weights, decode(data, device=DEVICE)).entries
                assert [StagedCopies] == [type(s) for s in staged]
                assert copied.receive(data).accepted
            assert first_difference(reference.weights, on_cpu(copied.weights)) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "float32"])
@pytest.mark.parametrize("how", ["in-mapping", "data"])
def test_copied_full_after_a_local_tensor_is_replaced(how, dtype):
    """A local tensor replaced after a full version was copied (a new tensor in the
    mapping, or new storage under the same tensor object): the next full version lands
    in the new tensor bit for bit as the reference and leaves the old storage alone; by
    the copy kernel at the new address, or, for a tensor of another dtype, by the
    reference ``copy_`` (the plan made for the old dtype is dropped, not reused)."""
    config, layout, kind = CASES[0]
    source = source_shard(config, kind)
    shard = sglang_shard(config, layout, rank=0)
    reference, copied = receiver_pair(source, shard, canonical_weights(config, 0))
    name = next(n for n in shard.tensors if "qkv_proj" in n)
    frames = [encode_full(materialize(source, canonical_weights(config, version)), stream_id="s",
                          version=version) for version in (2, 3)]
    assert reference.receive(frames[0]).accepted
    with kernels():
        assert copied.receive(frames[0]).accepted
    for receiver in (reference, copied):
        new = torch.full_like(receiver.weights[name], 3.0, dtype=dtype)
        old = receiver.weights[name].detach()
        if how == "data":
            receiver.weights[name].data = new
        else:
            receiver.weights[name] = new
    before = old.clone()
    assert reference.receive(frames[1]).accepted
    with kernels():
        staged = copied.stage(copied.weights, decode(frames[1], device=DEVICE)).entries
        assert (dtype == torch.bfloat16) == ([StagedCopies] == [type(s) for s in staged])
        assert copied.receive(frames[1]).accepted
    assert dtype == copied.weights[name].dtype
    assert first_difference(reference.weights, on_cpu(copied.weights)) is None
    assert torch.equal(before.view(torch.uint8), old.view(torch.uint8))


def test_a_local_tensor_replaced_by_a_strided_one_is_written_as_by_the_reference():
    """A local matrix replaced after a delta by a column-major tensor of the same shape,
    dtype and values: the kernels write row-major tensors, so the next full version
    lands in it as the reference writes it, element by element (not by the copy plan
    made for the row-major tensor)."""
    config, layout, source_kind = CASES[0]
    source = source_shard(config, source_kind)
    shard = sglang_shard(config, layout, rank=0)
    versions = [canonical_weights(config, 0)]
    versions += [stepped(versions[-1], seed, 0.1) for seed in (1, 2)]
    reference, routed = receiver_pair(source, shard, versions[0])
    name = next(n for n in shard.tensors if "qkv_proj" in n)
    first = delta_frame(source, versions[0], versions[1])
    second = encode_full(materialize(source, versions[2]), stream_id="s", version=3)
    assert reference.receive(first).accepted
    with kernels():
        assert routed.receive(first).accepted
    for receiver in (reference, routed):
        held = receiver.weights[name]
        strided = torch.empty_strided(held.shape, (1, held.shape[0]), dtype=held.dtype,
                                      device=held.device)
        receiver.weights[name] = strided.copy_(held)
    assert reference.receive(second).accepted
    with kernels():
        staged = routed.stage(routed.weights, decode(second, device=DEVICE)).entries
        assert StagedCopies not in [type(s) for s in staged]
        assert routed.receive(second).accepted
    assert not routed.weights[name].is_contiguous()
    assert first_difference(reference.weights, on_cpu(routed.weights)) is None
