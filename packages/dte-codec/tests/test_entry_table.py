"""The entry table's columns agree with ``Entry.validate`` and ``Entry.section_sizes``,
entry by entry, and the one-pass table reader with the field-by-field one."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from dte_codec.encodings import DTYPES, IndexEncoding, Kind, ValueEncoding
from dte_codec.entry import Entry
from dte_codec.entry_table import EXACT_NUMEL, EntryTable, Sections
from dte_codec.errors import HeaderError
from dte_codec.header import _Reader, Header
from dte_codec.section_views import entry_sections
from dte_codec.table_bytes import pack_table, read_table

SHAPES = [(), (0,), (1,), (5,), (3, 4), (7, 9, 11), (2**31,), (2**31 - 1,), (1,) * 16,
          (1,) * 17, (2**31, 2**31), (2**40,), (2**40 - 1,)]


def _entry(rng: random.Random) -> Entry:
    """An entry of random fields around every boundary ``Entry.validate`` draws: each
    field mostly one its encodings allow, else any of the boundary values."""
    shape = rng.choice(SHAPES)
    numel = 1
    for d in shape:
        numel *= d
    count = rng.choice([0, 1, 2, 3, max(numel - 1, 0), numel, numel, numel + 1, numel // 3 + 1])
    dtype = rng.choice(list(DTYPES.values()))
    index, value = rng.choice(list(IndexEncoding)), rng.choice(list(ValueEncoding))

    def pick(plausible: int, *boundary: int) -> int:
        return plausible if rng.random() < 0.85 else rng.choice(boundary)

    residue = value == ValueEncoding.RESIDUE
    return Entry(
        name=f"t{rng.randrange(10**6)}", dtype=dtype, shape=shape, count=count,
        index_encoding=index,
        index_width=pick(rng.randrange(63) if index == IndexEncoding.ELIAS_FANO else 0,
                         0, 1, 62, 63),
        index_escapes=pick(rng.randrange(count + 1) if index == IndexEncoding.GAP8 else 0,
                           0, 1, count, count + 1),
        value_encoding=value,
        value_width=pick(rng.randrange(1, dtype.itemsize * 8) if residue else 0,
                         0, 1, 15, 16, 31, 32),
        value_escapes=pick(rng.randrange(count + 1) if residue else 0, 0, 1, count, count + 1))


def _passes(entry: Entry, kind: Kind) -> bool:
    try:
        entry.validate(kind)
    except HeaderError:
        return False
    return True


@pytest.mark.parametrize("seed", range(4))
def test_columns_judge_and_size_every_entry_as_the_entry_does(seed):
    """Over thousands of boundary entries, the columns call an entry valid exactly when
    ``Entry.validate`` passes it, per kind; the section sizes of every valid entry, alone
    and in one table with the others, equal ``Entry.section_sizes`` size for size."""
    rng = random.Random(seed)
    entries = [_entry(rng) for _ in range(3000)]
    for entry, kind in itertools.product(entries, Kind):
        assert _passes(entry, kind) == EntryTable((entry,)).valid(kind), (entry, kind)
    valid = [e for e in entries if _passes(e, Kind.DELTA)]
    assert len(valid) > 300 and {e.index_encoding for e in valid} == set(IndexEncoding)
    assert any(e.numel >= EXACT_NUMEL for e in valid)  # sized by the entries themselves
    table = EntryTable(tuple(valid))
    assert table.valid(Kind.DELTA)
    assert tuple(s for e in valid for s in e.section_sizes()) == table.sections.sizes
    assert tuple(len(e.section_sizes()) for e in valid) == table.sections.per_entry
    small = EntryTable(tuple(e for e in valid if e.numel < EXACT_NUMEL))
    assert small.sections.sizes == tuple(s for e in small.entries for s in e.section_sizes())
    assert sum(e.body_bytes for e in valid) == table.sections.body_size
    assert sum(e.body_bytes for e in small.entries) == small.sections.body_size


@pytest.mark.parametrize("field", ["count", "index_escapes", "value_width"])
def test_fields_beyond_int64_are_judged_by_the_entries(field):
    """A field numpy cannot hold as int64 leaves the columns out: ``Header.validate``
    then raises the entry's own error."""
    fields = dict(name="w", dtype=torch.float32, shape=(4,), count=2,
                  index_encoding=IndexEncoding.INT32)
    entry = Entry(**{**fields, field: 2**64 - 1})
    header = Header(stream_id="s", kind=Kind.DELTA, base_version=0, payload_version=1,
                    entries=(entry,))
    with pytest.raises(HeaderError) as info:
        header.validate()
    assert info.value.tensor == "w" and info.value.got == 2**64 - 1


def test_one_pass_reader_reads_what_the_field_by_field_reader_reads():
    """A packed table of many entries reads back to the same entries both ways."""
    rng = random.Random(7)
    entries = tuple(e for e in (_entry(rng) for _ in range(500)) if _passes(e, Kind.DELTA))
    packed = pack_table(entries)
    reader = _Reader(memoryview(packed), len(packed))
    assert entries == tuple(reader.entry() for _ in entries)
    assert entries == read_table(packed, len(entries))
    assert read_table(packed[:-1], len(entries)) is None
    assert read_table(packed + b"\0", len(entries)) is None


def test_sections_are_the_same_bytes_in_one_segment_or_many():
    """``entry_sections`` of a body held as one segment gives the same section bytes as of the
    same body cut into uneven segments (sections across segments included)."""
    rng = random.Random(3)
    entries = tuple(e for e in (_entry(rng) for _ in range(400))
                    if _passes(e, Kind.DELTA) and e.numel < 10**4)
    header = Header(stream_id="s", kind=Kind.DELTA, base_version=0, payload_version=1,
                    entries=entries)
    body = torch.randint(0, 256, (header.body_size(),), dtype=torch.uint8)
    cuts = sorted(rng.sample(range(1, body.numel()), 50))
    pieces = tuple(torch.tensor_split(body, cuts))
    one, many = entry_sections(header, (body,)), entry_sections(header, pieces)
    assert [len(s) for s in one] == [len(e.section_sizes()) for e in entries]
    assert [[t.tolist() for t in s] for s in one] == [[t.tolist() for t in s] for s in many]


def test_sections_equal_by_their_sizes_however_held():
    """Sizes held as int64 arrays (the columns) and as tuples (the entries) compare and
    hash alike; one size, one entry's section count or the body size apart: unequal."""
    arrays = Sections(np.array([3, 8, 0]), np.array([2, 1]), 24)
    assert Sections((3, 8, 0), (2, 1), 24) == arrays
    assert hash(Sections((3, 8, 0), (2, 1), 24)) == hash(arrays)
    for other in (Sections((3, 9, 0), (2, 1), 24), Sections((3, 8, 0), (1, 2), 24),
                  Sections((3, 8, 0), (2, 1), 32)):
        assert other != arrays
