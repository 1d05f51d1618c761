"""The fused Triton kernels of the batched codec against the per-tensor reference.

On a CUDA device the kernels run there (marker ``gpu`` for the large cases); on the CPU
they run under Triton's interpreter, which this module switches on before the kernels
are first imported (``dispatch.interpreted``). Every check compares bytes, indices,
values or errors with the torch reference exactly, so one differing element fails it.
Index streams the encoder never writes and the decoder's stream and escape checks are
``test_decode_kernels.py``'s; the bit-field primitives ``test_kernel_bits.py``'s.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from codec_cases import (Change, HostReads, assert_apply_agrees, assert_corrupt_decodes_agree,
                         assert_decoders_agree, assert_encoders_agree, assert_residues_agree,
                         assert_stale_escapes_refused, tensor_and_change)
from hypothesis import example, given, settings
from hypothesis import strategies as st
from kernel_mode import CUDA, DEVICE, kernels, needs_triton

from dte_codec import apply_
from dte_codec.decode import decode_batched
from dte_codec.encode import encode_delta_batched, encode_delta_per_tensor
from dte_codec.errors import ApplyError

pytestmark = needs_triton
EXAMPLES = settings(max_examples=40 if CUDA else 6, deadline=None)
"""The interpreter runs a kernel as numpy per program: fewer examples on the CPU."""
CASE = tensor_and_change(largest=70**3 if CUDA else 5000)
"""On the CPU, random tensors of up to a few kernel blocks (one of 343,000 elements took
the interpreter 30 s); the explicit examples hold the larger streams."""


EDGES = [
    # count == numel (bitmap), L = 0 Elias-Fano, one element, a long run and far gaps
    [(torch.arange(600, dtype=torch.bfloat16),
      Change(torch.arange(600), *(torch.zeros(600, dtype=torch.bfloat16),) * 2))],
    [(torch.randn(3000).bfloat16(),
      Change(torch.arange(0, 3000, 2), *(torch.zeros(1500, dtype=torch.bfloat16),) * 2))],
    [(torch.randn(100000).half(),
      Change(torch.tensor([99999]), *(torch.ones(1, dtype=torch.float16),) * 2))],
    [(torch.randn(200000),  # GAP8: a run, then gaps over a byte
      Change(torch.cat([torch.arange(10, 2000), torch.tensor([9000, 150000, 199999])]),
             *(torch.zeros(1993),) * 2))],
]


def _across_blocks() -> list:
    """Tensors of several kernel blocks (1,024 elements) whose escapes sit on both sides
    of block boundaries: residues (Elias-Fano indices), GAP8 gaps, raw values, and a
    one-element tensor after them."""
    gen = torch.Generator().manual_seed(11)
    ef = torch.randn(50000, generator=gen).bfloat16()
    at = torch.arange(0, 50000, 20)
    step = torch.ones(at.numel(), dtype=torch.int64)
    step[[0, 1023, 1024, 2047, 2048, 2499]] = 1000
    base = (ef[at].view(torch.int16).to(torch.int64) - step).to(torch.int16).view(torch.bfloat16)
    gap8 = torch.randn(200000, generator=gen)
    run = torch.cat([torch.arange(0, 1024), torch.arange(5000, 5500), torch.arange(9000, 9600)])
    ints = torch.randint(-100, 100, (4000,), generator=gen, dtype=torch.int32)
    return [(ef, Change(at, base, base)),
            (gap8, Change(run, *(gap8[run],) * 2)),
            (ints, Change(torch.arange(0, 4000, 3), *(ints[:1334],) * 2)),
            (torch.ones(7, dtype=torch.float16),
             Change(torch.tensor([6]), *(torch.zeros(1, dtype=torch.float16),) * 2))]


def _residue_widths() -> list:
    """bf16 tensors of three kernel blocks whose residues need up to 3, 5, ..., 15 bits
    (widths that do not divide 64, so fields straddle words), with escapes at the blocks'
    first and last elements: each tensor's residue fields start mid-word."""
    gen = torch.Generator().manual_seed(7)
    cases = []
    for width in range(3, 16, 2):
        tensor = torch.randn(5000, generator=gen).bfloat16()
        at = torch.arange(0, 5000, 2)
        step = torch.randint(0, 1 << (width - 1), (at.numel(),), generator=gen)
        step[[0, 1023, 1024, 2047, 2048, 2499]] = 1 << (width + 3)
        base = (tensor[at].view(torch.int16).to(torch.int64) - step).to(torch.int16)
        cases.append((tensor, Change(at, *(base.view(torch.bfloat16),) * 2)))
    return cases


def _gap_escapes() -> list:
    """A GAP8 tensor of three kernel blocks (runs of neighbours far apart) with gaps over
    a byte in every block, on both sides of the block edges."""
    far = torch.zeros(3000, dtype=torch.int64)
    far[[0, 5, 700, 1023, 1024, 1500, 2047, 2048, 2900]] = 100_000
    at = torch.cumsum(far + 1, 0)
    tensor = torch.randn(int(at[-1]) + 1, generator=torch.Generator().manual_seed(3))
    return [(tensor, Change(at, *(tensor[at],) * 2))]


@EXAMPLES
@given(st.lists(CASE, max_size=6))
@example(_gap_escapes())
@example(_residue_widths())
@example(EDGES[0])
@example(_across_blocks())
@example(EDGES[1])
@example(EDGES[2])
@example(EDGES[3])
def test_kernel_encoder_writes_the_reference_bytes(cases):
    """Over dtypes, shapes, densities, gaps, bounds (so residue widths and escapes):
    byte-identical payloads."""
    with kernels():
        assert_encoders_agree(cases, DEVICE)


def test_kernel_encoder_writes_only_with_escapes_it_counted(monkeypatch):
    """``FusedFlat.write`` takes the ranks of its own ``count_escapes``, never a previous
    sync's."""
    from dte_codec.encode_kernel import FusedFlat
    with kernels():
        assert_stale_escapes_refused(monkeypatch, FusedFlat, DEVICE)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="counts compiled CUDA kernels")
def test_kernel_encoder_compiles_once_whatever_the_number_of_tensors():
    """Payloads of 1 to 33 tensors (tensor counts on both sides of powers of two) reuse
    one compiled variant of each encoder kernel."""
    from dte_codec import encode_kernel
    tensor, change = EDGES[1][0]
    for tensors in (1, 2, 3, 5, 9, 17, 33):
        new = {f"t{i}": tensor.to(DEVICE) for i in range(tensors)}
        changes = {name: Change(*(x.to(DEVICE) for x in attrs.astuple(change))) for name in new}
        expected = encode_delta_per_tensor(new, changes, stream_id="s", base_version=0, version=1)
        actual = encode_delta_batched(new, changes, stream_id="s", base_version=0, version=1)
        assert bytes(expected) == bytes(actual)
    for kernel in (encode_kernel._stats, encode_kernel._escape_counts, encode_kernel._write):
        assert 1 == sum(len(caches[0]) for caches in kernel.device_caches.values())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="counts compiled CUDA kernels")
def test_kernel_decoder_compiles_once_whatever_the_number_of_tensors():
    """Payloads of 1 to 33 entries (entry counts on both sides of powers of two) decode,
    resolve and apply through one compiled variant of each decoder, residue and scatter
    kernel: no entry count is a compile-time constant."""
    from dte_codec import decode_kernel, scatter_kernel, values_kernel
    # the count and write passes of _gaps are two variants (WRITE), and so
    # are the gather of the undo log and the scatter of _move (TO_FLAT)
    expected = {decode_kernel._fields: 1, decode_kernel._stream: 1, decode_kernel._gaps: 2,
                decode_kernel._check: 1, decode_kernel._positions: 1,
                values_kernel._resolve: 1, values_kernel._escaped: 1,
                scatter_kernel._move: 2}
    for kernel in expected:  # variants other tests compiled
        kernel.device_caches.clear()
    across = _across_blocks()
    for tensors in (1, 2, 3, 5, 9, 17, 33):
        cases = [across[k % len(across)] for k in range(tensors)]
        assert_decoders_agree(cases, DEVICE)
        assert_residues_agree(cases, True, tensors, DEVICE)
        assert_apply_agrees(cases, DEVICE)
    assert expected == {kernel: sum(len(caches[0]) for caches in kernel.device_caches.values())
                        for kernel in expected}


@EXAMPLES
@given(st.lists(CASE, max_size=6))
@example(EDGES[1] + EDGES[3])
def test_kernel_decoder_finds_the_change_sets(cases):
    """The kernel decoder finds every change set's indices, as the reference does."""
    with kernels():
        assert_decoders_agree(cases, DEVICE)


@EXAMPLES
@given(st.lists(CASE, min_size=1, max_size=4), st.data())
def test_kernel_decoder_rejects_what_the_reference_rejects(cases, data):
    """Corrupted bodies: the reference's error, or the reference's payload."""
    with kernels():
        assert_corrupt_decodes_agree(cases, data, DEVICE)


@EXAMPLES
@given(st.lists(CASE, min_size=1, max_size=4), st.booleans(),
       st.integers(0, 2**31 - 1))
@example(_across_blocks(), True, 0)
@example(EDGES[3] + _across_blocks(), False, 1)
def test_kernel_residues_resolve_as_the_reference(cases, inside, seed):
    """Residues against bases inside the bounds or arbitrary: same values or error."""
    with kernels():
        assert_residues_agree(cases, inside, seed, DEVICE)


@EXAMPLES
@given(st.lists(CASE, min_size=1, max_size=4))
@example(EDGES[0] + EDGES[2])
def test_kernel_apply_writes_the_sender_tensors(cases):
    """One gather and one scatter launch per device leave the receiver bit-equal to the
    sender, as the reference apply does."""
    with kernels():
        assert_apply_agrees(cases, DEVICE)


def test_kernel_apply_stages_one_batch_per_device():
    """Valid sparse entries are staged as one kernel batch, not entry by entry (the
    path a residue failure falls back to)."""
    from dte_codec.apply import StagedBatch, prepare
    data, receiver = _payload_and_base()
    with kernels():
        staged = prepare(receiver, [decode_batched(data, device=DEVICE)]).entries
    assert [StagedBatch] == [type(s) for s in staged]


def _payload_and_base():
    gen = torch.Generator().manual_seed(3)
    new = {f"w{i}": torch.randn(4000, generator=gen).bfloat16() for i in range(3)}
    base = {name: t.clone() for name, t in new.items()}
    changes = {}
    for name, t in base.items():
        at = torch.arange(1, 4000, 7)
        t.view(torch.int16)[at] += 1
        changes[name] = Change(at, t[at], t[at])
    data = encode_delta_per_tensor(new, changes, stream_id="s", base_version=0, version=1)
    return data, {name: t.to(DEVICE) for name, t in base.items()}


def test_kernel_apply_restores_every_tensor_when_the_write_fails(monkeypatch):
    """A scatter that fails after writing leaves every tensor at its base, from the
    gathered undo log, and raises ``ApplyError``."""
    from dte_codec.scatter_kernel import FlatEntries
    data, receiver = _payload_and_base()
    before = {name: t.clone() for name, t in receiver.items()}
    scatter = FlatEntries.scatter
    calls = []

    def failing(self, values):
        scatter(self, values)
        calls.append(len(values))
        if len(calls) == 1:
            raise RuntimeError("device error")

    monkeypatch.setattr(FlatEntries, "scatter", failing)
    with kernels(), pytest.raises(ApplyError) as info:
        apply_(receiver, decode_batched(data, device=DEVICE))
    assert "every tensor was restored" in str(info.value)
    assert [3, 3] == calls  # the write, then the undo
    for name, t in before.items():
        assert t.view(torch.int16).tolist() == receiver[name].view(torch.int16).tolist()


def test_kernel_paths_read_the_device_a_fixed_number_of_times():
    """Encode reads the device once (the statistics: ``cpu`` then ``numpy``; the body
    digest stays queued), decode once (both body digests and the failed-check count
    together: ``tolist``), apply once (the residue check)."""
    data, receiver = _payload_and_base()
    new = {"w": torch.randn(4000).bfloat16().to(DEVICE)}
    at = torch.arange(0, 4000, 9, device=DEVICE)
    changes = {"w": Change(at, new["w"][at], new["w"][at])}
    with kernels(), HostReads() as reads:
        encode_delta_batched(new, changes, stream_id="s", base_version=0, version=1)
    assert ["cpu", "numpy"] == reads.calls
    with kernels():
        payload = decode_batched(data, device=DEVICE)
        with HostReads() as reads:
            decode_batched(data, device=DEVICE)
        assert ["tolist"] == reads.calls
        with HostReads() as reads:
            apply_(receiver, payload)
    assert ["__int__"] == reads.calls


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (4 GB tensors)")
def test_kernels_past_two_to_the_31_elements():
    """Tensors of over 2**31 elements: a run with 64-bit gap escapes (GAP8) and far-apart
    indices in Elias-Fano with 28 low bits, encoded, decoded and applied exactly as the
    reference does."""
    numel = 2**31 + 1000
    new = {"run": torch.zeros(numel, dtype=torch.bfloat16, device="cuda"),
           "far": torch.zeros(numel, dtype=torch.bfloat16, device="cuda")}
    where = {"run": torch.cat([torch.arange(5, 3005), torch.tensor([2**31 - 1, 2**31 + 3,
                                                                     numel - 1])]),
             "far": torch.tensor([0, 300000, 2**31 - 1, 2**31 + 300, numel - 1])}
    changes = {}
    for name, at in where.items():
        at = at.cuda()
        new[name][at] = torch.randn(at.numel(), device="cuda").bfloat16()
        low = (new[name][at].view(torch.int16) - 1).view(torch.bfloat16)
        changes[name] = Change(at, low, low)
    expected = encode_delta_per_tensor(new, changes, stream_id="s", base_version=0, version=1)
    actual = encode_delta_batched(new, changes, stream_id="s", base_version=0, version=1)
    assert bytes(expected) == bytes(actual)
    payload = decode_batched(actual, device="cuda")
    assert [("GAP8", 2, 0), ("ELIAS_FANO", 0, 28)] == [
        (e.index_encoding.name, e.index_escapes, e.index_width) for e in payload.header.entries]
    for entry, found in zip(payload.header.entries, payload.indices):
        assert where[entry.name].tolist() == found.tolist()
    for name, change in changes.items():
        new[name][change.indices] = change.base_low  # the receiver's base
    apply_(new, payload)
    for name, at in where.items():
        got = new[name][at.cuda()].view(torch.int16)
        assert (changes[name].base_low.view(torch.int16) + 1).tolist() == got.tolist()


def test_kernel_apply_bumps_the_version_counters():
    """The scatter writes through addresses; each written tensor's version counter still
    moves, as with torch's in-place writes (autograd and outside-write checks read it)."""
    data, receiver = _payload_and_base()
    before = {name: t._version for name, t in receiver.items()}
    with kernels():
        apply_(receiver, decode_batched(data, device=DEVICE))
    assert all(receiver[name]._version > version for name, version in before.items())


def _owners_reference(blocks: torch.Tensor, total: int) -> torch.Tensor:
    owners = torch.arange(blocks.numel(), dtype=torch.int32, device=blocks.device)
    return torch.repeat_interleave(owners, blocks, output_size=total)


@EXAMPLES
@given(st.lists(st.integers(0, 9), max_size=12), st.sampled_from([2, 4, 1024]))
@example([0, 3, 0, 0, 5, 1, 0], 2)
def test_kernel_block_segments_equal_repeat_interleave(blocks, tile):
    """The block -> segment table of one launch (``block_kernel``) equals
    ``repeat_interleave``'s (the CPU path) element for element, with empty segments, and
    with tiles smaller than the segment count and than a segment's run of blocks (the
    prefix and the run each take several steps)."""
    from dte_codec.block_kernel import block_owners
    from dte_codec.fields import block_segments
    counts = torch.tensor(blocks, dtype=torch.int64, device=DEVICE)
    expected = _owners_reference(counts, sum(blocks))
    with kernels():
        found = block_owners(counts, sum(blocks), tile=tile)
        through = block_segments(counts, sum(blocks))
    assert torch.int32 == found.dtype == through.dtype
    assert torch.equal(expected, found) and torch.equal(expected, through)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="a model's table on a CUDA device")
def test_kernel_block_segments_of_thousands_of_segments():
    """Thousands of segments (several prefix tiles), runs of thousands of blocks, read
    from an odd row of a table (an address off 16 bytes): the reference's table."""
    gen = torch.Generator().manual_seed(3)
    table = torch.randint(0, 3000, (3, 4099), generator=gen).cuda()
    table[1, ::7] = 0
    blocks = table.view(-1)[1:4100]
    total = int(blocks.sum())
    from dte_codec.fields import block_segments
    assert torch.equal(_owners_reference(blocks, total), block_segments(blocks, total))
