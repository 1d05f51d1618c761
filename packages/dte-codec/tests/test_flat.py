"""The batched delta encoder writes exactly the reference encoder's bytes and the batched
decoder finds exactly the reference decoder's indices and errors, each with a fixed
number of host synchronizations. (``encode_delta`` and ``decode`` take the batched paths
on a GPU only; here they are called directly, on the CPU.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dte_codec.decode import decode_batched
from dte_codec.encode import encode_delta_batched, encode_delta_per_tensor
from dte_codec.errors import EncodeError
from dte_codec import fields
from dte_codec.fields import Body, PinnedStage, Segments, block_segments, host_tables
from dte_codec.flat_encode import TorchFlat
from dte_codec.indices import _bitmap, _elias_fano, _gap8, _raw, choose_indices, encode_indices
from hypothesis import example, given
from hypothesis import strategies as st

from codec_cases import (Change, HostReads, assert_corrupt_decodes_agree,
                         assert_decoders_agree, assert_encoders_agree,
                         assert_queued_digest_compared, assert_residues_agree,
                         assert_stale_escapes_refused, tensor_and_change)


@given(st.lists(tensor_and_change(), max_size=6))
@example([(torch.arange(600, dtype=torch.bfloat16),
           Change(torch.tensor([0, 299, 599]), *(torch.zeros(3, dtype=torch.bfloat16),) * 2))])
def test_flat_encoder_writes_the_reference_bytes(cases):
    """Over dtypes, shapes (0-d, empty), densities, gaps and bounds: byte-identical."""
    assert_encoders_agree(cases, "cpu")


@given(st.lists(tensor_and_change(), max_size=4), st.integers(0, 63))
def test_flat_encoder_leaves_its_digest_queued_and_decoders_compare_it(cases, bit):
    """The frame's header is the reference's once read; a queued digest one bit off is
    refused by every decoder."""
    assert_queued_digest_compared(cases, bit, "cpu")


def test_flat_encoder_writes_only_with_escapes_it_counted(monkeypatch):
    """``TorchFlat.write`` takes the ranks of its own ``count_escapes``, never a previous
    sync's."""
    assert_stale_escapes_refused(monkeypatch, TorchFlat, "cpu")


@given(st.lists(tensor_and_change(), max_size=6))
def test_flat_decoder_finds_the_change_sets(cases):
    """Decoding a delta gives back every change set's indices, as the reference does."""
    assert_decoders_agree(cases, "cpu")


@given(st.lists(tensor_and_change(), min_size=1, max_size=4), st.data())
def test_flat_decoder_rejects_what_the_reference_rejects(cases, data):
    """Body bytes overwritten (digest recomputed): the same error, or the same payload."""
    assert_corrupt_decodes_agree(cases, data, "cpu")


@given(st.lists(tensor_and_change(), min_size=1, max_size=4), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_flat_residues_resolve_as_the_reference(cases, inside, seed):
    """Against bases inside the bounds or arbitrary ones: the reference's values or error."""
    assert_residues_agree(cases, inside, seed, "cpu")


@given(count=st.integers(1, 5000), numel_shift=st.integers(0, 40),
       escapes=st.integers(0, 5000))
def test_closed_form_index_choice_matches_the_candidates(count, numel_shift, escapes):
    """``choose_indices`` picks what building every candidate picks, up to 2**40 elements."""
    numel = count + (count << numel_shift)
    escapes = min(escapes, count)
    gaps = torch.ones(count, dtype=torch.int64)
    gaps[:escapes] = numel // count  # > 255 once numel // count is
    big = int((gaps > 255).sum())
    indices = torch.cumsum(gaps, 0) - 1
    # the encoder before the closed form: build every candidate, keep the first smallest
    candidates = [_raw(indices, numel), _gap8(indices, numel), _elias_fano(indices, numel)]
    if numel <= 8 * candidates[0].size:
        candidates.append(_bitmap(indices, numel))
    expected = min(candidates, key=lambda c: c.size)
    chosen = choose_indices(count, numel, gap_escapes=big)
    assert expected.encoding == encode_indices(indices, numel).encoding
    assert (expected.encoding, expected.width, expected.escapes) == (
        chosen["index_encoding"], chosen.get("index_width", 0), chosen.get("index_escapes", 0))


@pytest.mark.parametrize("indices", [[3, 1], [0, 0], [-1, 2], [0, 8]])
def test_bad_change_set_raises_the_reference_error(indices):
    """A change set that does not fit its tensor raises what the reference raises."""
    tensors = {"ok": torch.zeros(4), "w": torch.zeros(8)}
    low = torch.zeros(2)
    changes = {"ok": Change(torch.tensor([1]), low[:1], low[:1]),
               "w": Change(torch.tensor(indices), low, low)}
    messages = []
    for encoder in (encode_delta_per_tensor, encode_delta_batched):
        with pytest.raises(EncodeError) as info:
            encoder(tensors, changes, stream_id="s", base_version=0, version=1)
        messages.append(str(info.value))
    assert messages[0] == messages[1]


@pytest.mark.parametrize("indices", [[0, 8], [1, 2]])
@pytest.mark.parametrize("versions", [(1, 1), (0, 2**63)])
def test_bad_versions_raise_the_reference_error(indices, versions):
    """Versions the header cannot carry (checked while the device counts): the reference's
    error, after the indices' when those are bad too."""
    tensors = {"w": torch.zeros(8)}
    low = torch.zeros(2)
    changes = {"w": Change(torch.tensor(indices), low, low)}
    base, version = versions
    messages = []
    for encoder in (encode_delta_per_tensor, encode_delta_batched):
        with pytest.raises(EncodeError) as info:
            encoder(tensors, changes, stream_id="s", base_version=base, version=version)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    assert ("indices" in messages[0]) == (indices == [0, 8])


@pytest.mark.parametrize("tensors", [1, 40])
def test_one_host_read_per_payload(tensors):
    """Encoding reads the device once, for 1 or 40 tensors: the statistics (``cpu``, then
    ``numpy`` on the host); the body stays where it is and its digest stays queued
    until the header bytes are asked for (``int``)."""
    gen = torch.Generator().manual_seed(tensors)
    weights = {f"w{i}": torch.randn(5000, generator=gen).to(torch.bfloat16)
               for i in range(tensors)}
    changes = {name: Change(torch.arange(0, 5000, 37), *(w[::37].clone(),) * 2)
               for name, w in weights.items()}
    with HostReads() as reads:
        frame = encode_delta_batched(weights, changes, stream_id="s", base_version=0, version=1)
    assert ["cpu", "numpy"] == reads.calls
    with HostReads() as reads:
        frame.header
    assert ["__int__"] == reads.calls


@pytest.mark.parametrize("tensors", [1, 40])
def test_one_host_read_per_decode(tensors):
    """Decoding a frame reads the device once, for 1 or 40 tensors: the body digest and
    the failed-check count together (``tolist``)."""
    gen = torch.Generator().manual_seed(tensors)
    weights = {f"w{i}": torch.randn(5000, generator=gen).to(torch.bfloat16)
               for i in range(tensors)}
    changes = {name: Change(torch.arange(i % 3, 5000, 37 + i), *(w[i % 3::37 + i].clone(),) * 2)
               for i, (name, w) in enumerate(weights.items())}
    data = encode_delta_batched(weights, changes, stream_id="s", base_version=0, version=1)
    with HostReads() as reads:
        decode_batched(data)
    assert ["tolist"] == reads.calls


@given(st.lists(st.integers(0, 40), min_size=1, max_size=300), st.integers(0, 2**31 - 1))
def test_runs_add_what_index_add_adds(words, seed):
    """The GPU path of ``Body.write`` (one add per run of equal words) adds the same words
    as a plain ``index_add_``, runs split or not."""
    gen = torch.Generator().manual_seed(seed)
    word = torch.tensor(words)
    bits = torch.randint(-2**62, 2**62, word.shape, generator=gen)
    body = Body(41 * 8, word.numel(), torch.device("cpu"))
    body._add_runs(word, bits, torch.arange(word.numel()) + 41)
    expected = torch.zeros(41, dtype=torch.int64).index_add_(0, word, bits)
    assert expected.tolist() == body.bytes().view(torch.int64).tolist()


@given(st.lists(st.integers(0, 30), max_size=8), st.integers(0, 2**31 - 1))
def test_histogram_counts_per_segment(counts, seed):
    """``Segments.histogram`` on the CPU equals per-bin prefix-sum counts (its GPU path),
    values outside the bins not counted."""
    gen = torch.Generator().manual_seed(seed)
    segs = Segments.of(counts, torch.device("cpu")) if counts else None
    if segs is None or not segs.total:
        return
    values = torch.randint(-1, 7, (segs.total,), generator=gen)
    expected = torch.stack([segs.sums(values == b) for b in range(5)], 1)
    assert expected.tolist() == segs.histogram(values, 5).tolist()


@given(st.lists(st.integers(0, 5), max_size=8))
def test_block_segments_name_each_blocks_owner(blocks):
    """Segments of 0 or more whole blocks: each block is owned by the segment whose run
    of blocks holds it, in order, empty segments owning none."""
    expected = [s for s, n in enumerate(blocks) for _ in range(n)]
    owners = block_segments(torch.tensor(blocks, dtype=torch.int64), sum(blocks))
    assert (torch.int32, expected) == (owners.dtype, owners.tolist())


def test_host_table_is_a_copy_off_cuda():
    """Off CUDA a table is the rows as an int64 copy, not a view of the caller's array."""
    columns = np.arange(12, dtype=np.int64).reshape(3, 4)
    table = fields.host_table(columns, torch.device("cpu"))
    columns[0, 0] = 99
    assert (torch.int64, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]) == (table.dtype,
                                                                            table.tolist())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory and CUDA events")
def test_a_pinned_stage_never_overwrites_a_table_still_being_copied(monkeypatch):
    """Tables through a thread's stage of 10 words (``host_tables``), one and two per
    copy, queued behind a long kernel so that no copy has run when the buffer wraps:
    every table arrives as written, on a 16-byte boundary (reusing the buffer before its
    copies completed would deliver later tables' words); a copy larger than the stage
    goes through memory pinned for it."""
    device = torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setitem(fields._stages.__dict__, device.index, PinnedStage(device, words=10))
    torch.cuda._sleep(200_000_000)  # keeps the stream busy while the tables are queued
    tables = [np.full((2, 2), k, dtype=np.int64) + np.arange(4).reshape(2, 2) for k in range(9)]
    copied = [fields.host_table(t, device) for t in tables[:5]]
    copied += host_tables([tables[5][:1, :1], tables[6]], device)  # 1 word, padded to 2
    copied += host_tables(tables[7:], device)
    assert [t.tolist() for t in tables[:5]] == [c.tolist() for c in copied[:5]]
    assert [[[tables[5][0, 0]]], *(t.tolist() for t in tables[6:])] == [
        c.tolist() for c in copied[5:]]
    assert all(c.data_ptr() % 16 == 0 for c in copied)
    oversized = np.arange(11, dtype=np.int64)[None]
    assert oversized.tolist() == fields.host_table(oversized, device).tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory and CUDA events")
def test_a_pinned_stage_waits_only_for_the_copies_it_overwrites():
    """A stage of 8 words: a copy queued before a long kernel, one behind it, then one that
    wraps onto the first's words: it waits for the first copy only, so the host gets
    past it while the kernel still runs (waiting for every copy would return after it)."""
    device = torch.device("cuda", torch.cuda.current_device())
    stage = PinnedStage(device, words=8)
    tables = [np.full(4, k, dtype=np.int64) for k in range(3)]
    first = stage.copy([tables[0]], [0], 4)
    torch.cuda._sleep(500_000_000)
    behind = stage.copy([tables[1]], [0], 4)
    wrapped = stage.copy([tables[2]], [0], 4)
    assert not torch.cuda.current_stream(device).query()  # the kernel still runs
    assert [t.tolist() for t in tables] == [c.tolist() for c in (first, behind, wrapped)]


@given(st.lists(st.tuples(st.integers(1, 4), st.integers(0, 5)), min_size=1, max_size=5))
def test_host_tables_give_each_table_on_a_16_byte_boundary(shapes):
    """Tables of odd and even sizes copied together: each holds its own values in its
    shape, starts on 16 bytes (Triton's pointer specialization), and is a copy."""
    gen = np.random.default_rng(len(shapes))
    tables = [gen.integers(-2**62, 2**62, size=shape) for shape in shapes]
    copied = host_tables(tables, torch.device("cpu"))
    assert [t.tolist() for t in tables] == [t.tolist() for t in copied]
    assert all(t.data_ptr() % 16 == 0 and t.is_contiguous() for t in copied)
    tables[0][...] = 7
    assert copied[0].numel() == 0 or (copied[0] != 7).any()

