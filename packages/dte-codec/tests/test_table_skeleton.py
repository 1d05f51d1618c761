"""A delta's entry table read through the skeleton of the stream's previous one gives the
entries, columns and errors of the field by field reading."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from dte_codec.encodings import IndexEncoding, Kind, ValueEncoding
from dte_codec.entry import Entry
from dte_codec.entry_table import EntryTable, _columns
from dte_codec.errors import HeaderError
from dte_codec.header import Header
from dte_codec.table_bytes import _parsed, _skeletons
from forge import redigest

PRELUDE_BYTES = struct.calcsize("<4sHBBIIqqQQHQ")
FIELDS = {"index_encoding": (2, "B"), "value_encoding": (3, "B"), "index_width": (4, "B"),
          "value_width": (5, "B"), "reserved": (6, "H"), "count": (8, "Q"),
          "index_escapes": (16, "Q"), "value_escapes": (24, "Q")}
"""Offsets inside an entry's fields, as FORMAT.md lays them out."""


def _entries(sync: int, names=("a.weight", "b.weight", "c.bias")) -> tuple[Entry, ...]:
    """A stream's table at one sync: the same tensors, counts and encodings that move."""
    shapes = ((6, 40), (300,), (7,))
    out = []
    for k, (name, shape) in enumerate(zip(names, shapes)):
        count = 1 + (sync * 3 + k) % 5
        residue = (sync + k) % 2 == 0
        index = (IndexEncoding.GAP8, IndexEncoding.ELIAS_FANO, IndexEncoding.INT32)[(sync + k) % 3]
        out.append(Entry(name=name, dtype=torch.bfloat16 if k else torch.float32, shape=shape,
                         count=count, index_encoding=index,
                         index_width=2 if index == IndexEncoding.ELIAS_FANO else 0,
                         index_escapes=int(index == IndexEncoding.GAP8 and sync % 2),
                         value_encoding=ValueEncoding.RESIDUE if residue else ValueEncoding.RAW,
                         value_width=3 if residue else 0, value_escapes=int(residue)))
    return tuple(out)


def _header(entries: tuple[Entry, ...], sync: int) -> Header:
    return Header(stream_id="s", kind=Kind.DELTA, base_version=sync, payload_version=sync + 1,
                  entries=entries)


def _read(head: bytes, body_size: int) -> Header:
    return Header.unpack_head(memoryview(redigest(head)), body_size)


def _field_at(head: bytes, entry: int, field: str) -> tuple[int, str]:
    """Byte offset in ``head`` of ``field`` of the ``entry``-th entry, and its format."""
    pos = PRELUDE_BYTES + len("s")
    for _ in range(entry):
        (n_name,) = struct.unpack_from("<H", head, pos)
        ndim = head[pos + 2 + n_name + 1]
        pos += 2 + n_name + 32 + 8 * ndim
    (n_name,) = struct.unpack_from("<H", head, pos)
    offset, fmt = FIELDS[field]
    return pos + 2 + n_name + offset, fmt


@pytest.fixture(autouse=True)
def _fresh():
    """Each test starts as a reader that has seen no table."""
    _skeletons.clear()
    _parsed.clear()
    yield
    _skeletons.clear()
    _parsed.clear()


def test_later_deltas_are_read_through_the_first_ones_skeleton():
    """The first delta is read field by field and keeps its skeleton; the next ones of
    the stream come through it (one object), equal entry for entry and column for column
    to what they were packed from, and sized as the entries size them."""
    headers = [_header(_entries(sync), sync) for sync in range(5)]
    read = [_read(h.pack(), h.body_size()) for h in headers]
    assert read[0].skeleton() is not None
    assert all(r.skeleton() is read[0].skeleton() for r in read[1:])
    for header, parsed in zip(headers, read):
        assert header == parsed
        assert header.entries == tuple(parsed.entries)
        expected = _columns(header.entries)
        assert expected.keys() == parsed.columns().keys()
        for name, column in expected.items():
            assert column.tolist() == parsed.columns()[name].tolist(), name
        assert tuple(s for e in header.entries for s in e.section_sizes()) == \
            parsed.sections().sizes
        assert ("a.weight", "b.weight", "c.bias") == parsed.names()


def test_entries_are_built_only_when_asked_for():
    """Reading a delta through its skeleton builds no ``Entry``; asking for one builds that
    one, equal to the packed entry."""
    first, second = _header(_entries(0), 0), _header(_entries(1), 1)
    _read(first.pack(), first.body_size())
    parsed = _read(second.pack(), second.body_size())
    made = parsed.entries._made
    assert [None, None, None] == made
    assert second.entries[1] == parsed.entries[1]
    assert [None, second.entries[1], None] == made


@pytest.mark.parametrize("change", ["name", "dtype", "shape"])
def test_a_changed_static_byte_is_read_field_by_field(change):
    """A table of the same size and count whose name, dtype or shape differs is read
    afresh: its entries are its own, not the skeleton's."""
    first = _header(_entries(0), 0)
    _read(first.pack(), first.body_size())
    entries = list(_entries(1))
    if change == "name":
        entries[0] = Entry(**{**_fields(entries[0]), "name": "z.weight"})
    elif change == "dtype":
        entries[2] = Entry(**{**_fields(entries[2]), "dtype": torch.float16})
    else:
        entries[1] = Entry(**{**_fields(entries[1]), "shape": (301,)})
    second = _header(tuple(entries), 1)
    parsed = _read(second.pack(), second.body_size())
    assert tuple(entries) == tuple(parsed.entries)
    assert second == parsed


def _fields(entry: Entry) -> dict:
    return {name: getattr(entry, name) for name in (
        "name", "dtype", "shape", "count", "index_encoding", "index_width", "index_escapes",
        "value_encoding", "value_width", "value_escapes")}


@pytest.mark.parametrize(("entry", "field", "value"), [
    (0, "index_encoding", 99), (1, "value_encoding", 7), (2, "reserved", 1),
    (0, "count", 241), (1, "count", 2**64 - 1), (2, "index_escapes", 2**62),
    (1, "value_width", 16), (1, "value_width", 0), (2, "index_width", 5),
    (1, "value_escapes", 9), (0, "index_encoding", int(IndexEncoding.DENSE)),
])
def test_a_bad_varying_field_raises_what_the_field_by_field_reading_raises(entry, field, value):
    """A delta whose static bytes match the skeleton but whose varying field is wrong is
    refused with the very error (field, tensor, expected, got) a reader that never saw
    the stream raises."""
    first, second = _header(_entries(0), 0), _header(_entries(1), 1)
    head = bytearray(second.pack())
    at, fmt = _field_at(bytes(head), entry, field)
    struct.pack_into("<" + fmt, head, at, value)
    with pytest.raises(HeaderError) as fresh:
        _read(bytes(head), second.body_size())
    _read(first.pack(), first.body_size())
    assert _skeletons
    with pytest.raises(HeaderError) as through:
        _read(bytes(head), second.body_size())
    assert (fresh.value.field, fresh.value.tensor, str(fresh.value)) == (
        through.value.field, through.value.tensor, str(through.value))


def test_columns_of_a_skeleton_read_validate_as_the_entries():
    """A table read through the skeleton is judged by its columns as its entries judge
    themselves: valid in a delta, sized alike."""
    first, second = _header(_entries(0), 0), _header(_entries(2), 2)
    _read(first.pack(), first.body_size())
    parsed = _read(second.pack(), second.body_size())
    table = EntryTable(parsed.entries)
    assert table.valid(Kind.DELTA)
    assert np.array_equal(table.columns["count"], [e.count for e in second.entries])
    assert EntryTable(second.entries).sections == table.sections
