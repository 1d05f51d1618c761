"""The decoder kernels on index streams and escape positions, against the per-entry
reference: Elias-Fano and bitmap streams forced on entries whatever the encoder would
pick (no low bits, INT64 indices, long runs of set bits, empty words, block edges),
the same streams corrupted, and residue escape positions out of range or order.

On a CUDA device the kernels run there; on the CPU under Triton's interpreter
(``kernel_mode``). Every check compares indices, values or errors with the reference
exactly, so one differing element fails it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from codec_cases import assert_same_outcome
from forge import redigest
from kernel_mode import DEVICE, kernels, needs_triton

from dte_codec.decode import decode_batched, decode_per_entry

pytestmark = needs_triton


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
