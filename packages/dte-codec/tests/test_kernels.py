"""The fused Triton kernels of the batched codec against the per-tensor reference.

On a CUDA device the kernels run there (marker ``gpu`` for the large cases); on the CPU
they run under Triton's interpreter, which this module switches on before the kernels
are first imported (``dispatch.interpreted``). Every check compares bytes, indices,
values or errors with the torch reference exactly, so one differing element fails it.
"""

from __future__ import annotations

import importlib.util

import attrs
import numpy as np
import pytest
import torch
from codec_cases import (Change, HostReads, assert_apply_agrees, assert_corrupt_decodes_agree,
                         assert_decoders_agree, assert_encoders_agree, assert_residues_agree,
                         assert_same_outcome, assert_stale_escapes_refused, tensor_and_change)
from forge import redigest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from kernel_mode import CUDA, DEVICE, kernels, needs_triton

from dte_codec import apply_
from dte_codec.decode import decode_batched, decode_per_entry
from dte_codec.encode import encode_delta_batched, encode_delta_per_tensor
from dte_codec.errors import ApplyError
from dte_codec.fields import WORD_BITS, Body

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
    """Encode reads the device twice (the statistics: ``cpu`` then ``numpy``; the body
    digest: ``__int__``), decode once (the body digest and the failed-check count
    together: ``tolist``), apply once (the residue check)."""
    data, receiver = _payload_and_base()
    new = {"w": torch.randn(4000).bfloat16().to(DEVICE)}
    at = torch.arange(0, 4000, 9, device=DEVICE)
    changes = {"w": Change(at, new["w"][at], new["w"][at])}
    with kernels(), HostReads() as reads:
        encode_delta_batched(new, changes, stream_id="s", base_version=0, version=1)
    assert ["cpu", "numpy", "__int__"] == reads.calls
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


def _forced(specs) -> tuple:
    """A delta frame whose entries ``(name, indices, numel, encoding)`` carry their indices
    in the given encoding, whether or not the encoder would pick it; and its header."""
    from dte_codec.encodings import IndexEncoding, Kind
    from dte_codec.entry import Entry
    from dte_codec.header import Header
    from dte_codec.indices import _bitmap, _elias_fano
    from dte_codec.parts import Part, assemble
    parts = []
    for name, at, numel, encoding in specs:
        fields = {"index_encoding": encoding}
        if encoding == IndexEncoding.INT64:
            sections = (at.to(torch.int64).view(torch.uint8),)
        else:
            encoded = (_elias_fano if encoding == IndexEncoding.ELIAS_FANO else _bitmap)(at, numel)
            assert encoding == encoded.encoding
            fields["index_width"] = encoded.width
            sections = encoded.sections
        entry = Entry(name=name, dtype=torch.bfloat16, shape=(numel,), count=at.numel(), **fields)
        values = torch.arange(at.numel()).bfloat16()
        parts.append(Part(entry, sections + (values.view(torch.uint8),)))
    frame = assemble(parts, stream_id="s", kind=Kind.DELTA, base_version=0, version=1)
    return frame, Header.unpack_head(memoryview(frame.header), frame.body_size)


def _assert_flat_decodes(specs) -> None:
    """The kernels decode every entry of ``specs`` to exactly its indices, as the reference
    does: one differing index fails."""
    from dte_codec.flat_decode import decode_indices_flat
    frame, header = _forced(specs)
    with kernels():
        flat = decode_indices_flat(header, frame.body().to(DEVICE))
    assert 0 == int(flat.failures)
    expected = [at.tolist() for _, at, _, _ in specs]
    assert expected == [i.tolist() for i in flat.indices]
    assert expected == [i.tolist() for i in decode_per_entry(frame).indices]


def test_kernel_decoder_reads_encodings_the_encoder_never_picks():
    """Elias-Fano with no low bits (L = 0) and INT64 indices of a small tensor are legal
    payloads that the encoder never writes (a bitmap or INT32 is smaller): decoded by the
    kernels to the reference's indices."""
    from dte_codec.encodings import IndexEncoding
    from dte_codec.indices import _elias_fano
    many = torch.cat([torch.arange(0, 400), torch.arange(401, 700)])  # 699 of 700
    assert 0 == _elias_fano(many, 700).width
    _assert_flat_decodes([("ef", many, 700, IndexEncoding.ELIAS_FANO),
                          ("wide", torch.arange(3, 700, 3), 700, IndexEncoding.INT64)])


def _streams() -> dict:
    """Elias-Fano upper streams and bitmaps the element-side select must walk: long runs of
    set bits, runs of empty words, streams of more than one kernel block of words, and
    entries whose element counts sit on both sides of block edges."""
    from dte_codec.encodings import IndexEncoding
    ef, bitmap = IndexEncoding.ELIAS_FANO, IndexEncoding.BITMAP
    gen = torch.Generator().manual_seed(5)
    half = torch.nonzero(torch.rand(40000, generator=gen) < 0.5).flatten()
    holes = torch.cat([torch.arange(0, 700), torch.arange(9000, 9300), torch.tensor([69999])])
    return {
        "runs": [("run", torch.arange(0, 5000), 6000, ef),  # L = 0, 5,000 bits set in a row
                 ("cluster", torch.cat([torch.arange(100, 2600), torch.arange(90000, 90500)]),
                  100000, ef)],
        "empty words": [("far", torch.cat([torch.arange(0, 2000),
                                           torch.arange(999990, 1000000)]), 1000000, ef),
                        ("holes", holes, 70000, bitmap)],
        "many blocks": [("half", half, 40000, bitmap),  # 625 stream words: 2 blocks
                        ("spread", torch.arange(0, 700000, 50), 700000, ef)],  # 561 words
        "block edges": [(f"{kind.name}{n}", torch.arange(0, 3 * n, 3), 3 * n + 5, kind)
                        for n in (1, 1023, 1024, 1025, 2049) for kind in (ef, bitmap)],
    }


@pytest.mark.parametrize("name", list(_streams()))
def test_kernel_decoder_selects_the_set_bits_of_every_stream(name):
    """Elias-Fano and bitmap entries whose set bits come in long runs, behind empty words,
    across kernel blocks of words and of elements: exactly the reference's indices."""
    _assert_flat_decodes(_streams()[name])


@pytest.mark.parametrize("name", list(_streams()))
def test_kernel_decoder_rejects_corrupt_streams_as_the_reference(name):
    """Per stream of each entry: a set bit cleared (too few), a set bit moved (as many,
    other indices), a padding bit set past the stream's end: the reference's error or
    payload, never an index read out of the body. Each entry goes in a frame of its own
    (the interpreter's time grows with every entry decoded); corruption in frames of
    several entries is ``test_kernel_decoder_rejects_what_the_reference_rejects``'s."""
    from dte_codec.encodings import IndexEncoding, align
    for spec in _streams()[name]:
        frame, header = _forced([spec])
        data = bytes(frame)
        (entry,) = header.entries
        sizes = entry.section_sizes()
        stream = 1 if entry.index_encoding == IndexEncoding.ELIAS_FANO else 0
        start = len(data) - header.body_size() + sum(align(size) for size in sizes[:stream])
        end = start + sizes[stream]
        first = next(k for k in range(start, end) if data[k])
        padding = (end - start) * 8 - {IndexEncoding.ELIAS_FANO: entry.count + (
            (entry.numel - 1) >> entry.index_width) + 1, IndexEncoding.BITMAP: entry.numel}[
            entry.index_encoding]
        edits = [{first: data[first] & (data[first] - 1)},
                 {first: data[first] & (data[first] - 1), end - 1: data[end - 1] | 0x80}]
        if padding:  # bits past the stream's limit inside its last byte
            edits.append({end - 1: data[end - 1] | 0x80})
        for edit in edits:
            payload = bytearray(data)
            for k, byte in edit.items():
                payload[k] = byte
            with kernels():
                assert_same_outcome(redigest(payload), DEVICE)


if importlib.util.find_spec("triton") is not None:
    import triton
    import triton.language as tl

    from dte_codec.kernel_bits import load_uniform, put_fields, put_packed, store_uniform

    @triton.jit
    def _loads(address, out, size, n, BLOCK: tl.constexpr):
        k = tl.arange(0, BLOCK)
        width = tl.load(size)
        tl.store(out + k, load_uniform(address, k, width, k < n))

    @triton.jit
    def _stores(first, second, values, size, n, BLOCK: tl.constexpr):
        k = tl.arange(0, BLOCK)
        width = tl.load(size)
        value = tl.load(values + k)
        store_uniform(first, k, value, width, k < n)  # one address
        store_uniform(second + k * 0, k, value, width, k < n)  # an address per element

    @triton.jit
    def _put(words, pos, value, width, n, BLOCK: tl.constexpr):
        k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = k < n
        has_next = (tl.arange(0, BLOCK) < BLOCK - 1) & (k + 1 < n)
        put_fields(words, tl.load(pos + k, mask=valid, other=0),
                   tl.load(value + k, mask=valid, other=0),
                   tl.load(width + k, mask=valid, other=0), valid,
                   tl.load(pos + k + 1, mask=has_next, other=0), has_next)

    @triton.jit
    def _packed(words, pos, value, width, n, BLOCK: tl.constexpr):
        k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = k < n
        put_packed(words, tl.load(pos + k, mask=valid, other=0) +
                   tl.where(valid, 0, (k - n + 1) * tl.load(width)),
                   tl.load(value + k, mask=valid, other=0), tl.load(width), valid, BLOCK)

PUT_BLOCKS = (64, 128)
"""Blocks of one prefix-sum row (``kernel_bits.SCAN_ROW``) and of two."""
PACKED_BLOCK = 64
"""64 fields of any width that divides 64 fill whole words: each block starts a word."""
WIDTHS = (0, 1, 5, 8, 16, 33, 63, 64)


def _stream(width: int, written: list[bool], values: list[int], start: int):
    """Positions, values and widths of one stream starting at bit ``start``: an element
    that writes nothing has width 0 at the position of the stream's next field."""
    widths = torch.tensor([width if w else 0 for w in written], dtype=torch.int64)
    pos = start + torch.cumsum(widths, 0) - widths
    return pos, torch.tensor(values, dtype=torch.int64), widths


def _end(pos: torch.Tensor, widths: torch.Tensor, start: int) -> int:
    """The word-aligned bit where the next section starts."""
    end = int((pos + widths).max()) if pos.numel() else start
    return -(-end // WORD_BITS) * WORD_BITS


def _laid_out(sections, lead: int) -> tuple[list, torch.Tensor]:
    """The streams of ``sections``, each starting the word after the last one's end (the
    first ``lead`` words in), and the words the torch writer makes of them (one spare)."""
    start, parts = lead * WORD_BITS, []
    for width, written, values in sections:
        parts.append(_stream(width, written, values, start))
        start = _end(parts[-1][0], parts[-1][2], start)
    expected = Body(start // 8 + 8, sum(p[0].numel() for p in parts), torch.device("cpu"))
    expected.write(*(torch.cat(column) for column in zip(*parts)))
    return parts, expected.bytes().view(torch.int64)


streams = st.integers(0, 70).flatmap(lambda n: st.tuples(
    st.sampled_from(WIDTHS), st.lists(st.booleans(), min_size=n, max_size=n),
    st.lists(st.integers(-2**63, 2**63 - 1), min_size=n, max_size=n)))


@settings(max_examples=60 if CUDA else 12, deadline=None)
@given(st.lists(streams, min_size=1, max_size=3), st.integers(0, 3))
@example([(63, [True] * 40, [-1] * 40), (1, [True] * 70, [1] * 70)], 1)
@example([(64, [True, False] * 20, [-1, 5] * 20), (0, [True] * 3, [7] * 3)], 0)
@example([(5, [False] * 17 + [True] * 30, [-1] * 47), (33, [True, False, False] * 20,
                                                          list(range(60)))], 2)
@example([(16, [], []), (8, [False] * 16, [255] * 16)], 0)
def test_put_fields_writes_the_words_of_the_torch_writer(sections, lead):
    """Every word equals the torch writer's (which adds field by field), whatever the
    widths, escapes and block edges; fields of a section never reach the next one."""
    parts, expected = _laid_out(sections, lead)
    for block in PUT_BLOCKS:
        words = torch.zeros_like(expected, device=DEVICE)
        for pos, value, width in parts:
            if pos.numel():
                _put[(triton.cdiv(pos.numel(), block),)](
                    words, pos.to(DEVICE), value.to(DEVICE), width.to(DEVICE), pos.numel(),
                    BLOCK=block)
        assert expected.tolist() == words.cpu().tolist()


@settings(max_examples=40 if CUDA else 10, deadline=None)
@given(st.lists(st.integers(0, 6).flatmap(lambda g: st.integers(0, 200).flatmap(
    lambda n: st.tuples(st.just(64 >> g), st.just([True] * n),
                        st.lists(st.integers(-2**63, 2**63 - 1), min_size=n, max_size=n)))),
    min_size=1, max_size=3), st.integers(0, 3))
@example([(1, [True] * 130, [-1] * 130), (64, [True] * 3, [-5] * 3)], 1)
@example([(2, [True] * 65, list(range(65))), (32, [True] * 1, [2**40])], 0)
def test_put_packed_writes_the_words_of_the_torch_writer(sections, lead):
    """Streams of consecutive fields of 1 to 64 bits, in blocks that each start a word:
    every word equals the torch writer's, none past a stream's last field is
    written (the next section starts right after it)."""
    parts, expected = _laid_out(sections, lead)
    words = torch.zeros_like(expected, device=DEVICE)
    for (width, _, _), (pos, value, _) in zip(sections, parts):
        if pos.numel():
            _packed[(triton.cdiv(pos.numel(), PACKED_BLOCK),)](
                words, pos.to(DEVICE), value.to(DEVICE),
                torch.tensor([width], device=DEVICE), pos.numel(), BLOCK=PACKED_BLOCK)
    assert expected.tolist() == words.cpu().tolist()



@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
def test_load_uniform_reads_items_as_int64(dtype):
    """Items of 1, 2, 4 and 8 bytes, negative ones included, and masked-off lanes: int64
    values, 1-byte items zero-extended, the others sign-extended, masked lanes 0."""
    info = torch.iinfo(dtype)
    values = torch.tensor([info.min, -1 if info.min else 200, 0, 1, info.max], dtype=dtype)
    out = torch.full((8,), 7, dtype=torch.int64, device=DEVICE)
    values = values.to(DEVICE)
    with kernels():
        _loads[(1,)](values.data_ptr(), out, torch.tensor([values.element_size()],
                     device=DEVICE), values.numel(), BLOCK=8)
    expected = values.to(torch.int64).tolist() + [0] * 3
    assert expected == out.cpu().tolist()


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
def test_store_uniform_writes_the_low_bytes(dtype):
    """Items of 1, 2, 4 and 8 bytes from int64 values beyond their range: their low bytes
    stored, through one address or one address per element, masked-off lanes left
    alone."""
    values = torch.tensor([-(1 << 40) - 3, -1, 0, 1, (1 << 40) + 255, 9, 9, 9])
    first = torch.full((8,), 5, dtype=dtype, device=DEVICE)
    second = first.clone()
    with kernels():
        _stores[(1,)](first.data_ptr(), second.data_ptr(), values.to(DEVICE),
                      torch.tensor([first.element_size()], device=DEVICE), 5, BLOCK=8)
    low = values[:5].numpy().astype(torch.empty(0, dtype=dtype).numpy().dtype).tolist()
    assert low + [5, 5, 5] == first.cpu().tolist() == second.cpu().tolist()


@pytest.mark.parametrize("positions", [(0, 2), (1, 1), (1, 0), (-1, 1), (0, 1)],
                         ids=["past-count", "repeated", "decreasing", "negative", "valid"])
def test_kernel_decoder_checks_escape_positions_as_the_reference(positions):
    """The residue escape positions of the second of two entries (int32, ``count`` 2):
    out of range, repeated, decreasing or negative, the kernel check refuses the payload
    with the reference's error; valid, both decode the same values."""
    import struct

    from dte_codec.encodings import IndexEncoding, Kind, ValueEncoding, align
    from dte_codec.entry import Entry
    from dte_codec.errors import CodecError
    from dte_codec.header import Header
    entries = tuple(Entry(name=name, dtype=torch.bfloat16, shape=(10,), count=2,
                          index_encoding=IndexEncoding.INT32,
                          value_encoding=ValueEncoding.RESIDUE, value_width=2,
                          value_escapes=escapes)
                    for name, escapes in (("a", 1), ("b", 2)))
    sections = [struct.pack("<ii", 1, 2), b"\x01", struct.pack("<i", 0), bytes(2),
                struct.pack("<ii", 3, 4), b"", struct.pack("<ii", *positions), bytes(4)]
    header = Header(stream_id="s", kind=Kind.DELTA, base_version=0, payload_version=1,
                    entries=entries)
    data = redigest(header.pack() + b"".join(s.ljust(align(len(s)), b"\0") for s in sections))
    outcomes = []
    for decoder, where in ((decode_per_entry, "cpu"), (decode_batched, DEVICE)):
        try:
            with kernels():
                payload = decoder(data, device=where)
            outcomes.append([[s.tolist() for s in v] for v in payload.values])
        except CodecError as exc:
            outcomes.append(f"{type(exc).__name__}: {exc}")
    assert outcomes[0] == outcomes[1]
    assert (positions == (0, 1)) == isinstance(outcomes[0], list)


def test_kernel_escape_check_counts_every_bad_position():
    """The kernel's count of bad residue escape positions equals the reference's, one per
    bad position, across the blocks of an entry and across entries (int32 and int64
    positions)."""
    from dte_codec.decode_kernel import BLOCK, escape_failures
    rng = np.random.default_rng(5)
    entries = [(np.int32, BLOCK + 90, 4 * BLOCK), (np.int64, 7, 20), (np.int32, 3, 3)]
    positions, expected = [], 0
    for dtype, escapes, count in entries:
        p = np.sort(rng.choice(count, escapes, replace=False)).astype(dtype)
        bad = rng.choice(escapes, max(escapes // 40, 1), replace=False)
        p[bad] = rng.choice([-1, count, count + 5], bad.size)
        previous = np.concatenate([[-1], p[:-1]])
        expected += int(((p < 0) | (p >= count) | ((np.arange(escapes) > 0)
                                                   & (p <= previous))).sum())
        positions.append(torch.from_numpy(p).to(DEVICE))
    with kernels():
        got = escape_failures(np.array([e for _, e, _ in entries]),
                              np.array([p.data_ptr() for p in positions]),
                              np.array([p.element_size() for p in positions]),
                              np.array([c for _, _, c in entries]), torch.device(DEVICE))
    assert expected == int(got)


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
