"""An entry table's bytes: packing entries, reading a table in one pass, and the caches
of the tables packed, built and read lately (a stream sends the same table sync after sync).

``FORMAT.md`` specifies the entry layout; ``header`` reads a table through these, and
field by field where the one-pass reading gives way, to name the wrong field.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable

from typing import TYPE_CHECKING

from .encodings import (DTYPE_CODES, DTYPES, INDEX_ENCODINGS, MAX_NDIM, SIZE_LIMIT,
                        VALUE_ENCODINGS)
from .entry import Entry

if TYPE_CHECKING:
    from .entry_table import EntryTable
    from .table_skeleton import Entries, Skeleton

NAME_LENGTH = struct.Struct("<H")
ENTRY_FIELDS = struct.Struct("<BBBBBBHQQQ")
SHAPE_DIM = struct.Struct("<Q")


TABLE_CACHE = 8
"""Entry tables remembered (packed, parsed, validated): a stream sends the same table
sync after sync, a receiver may serve a few streams; each costs O(entries) once."""


def new_table(entries: tuple[Entry, ...]) -> EntryTable:
    # imported here: entry_table imports table_skeleton, which imports this module
    from .entry_table import EntryTable

    return EntryTable(entries)


@functools.lru_cache(maxsize=TABLE_CACHE)
def cached_entry_table(entries: tuple[Entry, ...]) -> EntryTable:
    _built[entries] = entries
    if len(_built) > TABLE_CACHE:
        _built.pop(next(iter(_built)))
    return new_table(entries)


_built: dict[tuple[Entry, ...], tuple[Entry, ...]] = {}
"""The full tables given to ``cached_entry_table`` lately. A table read from bytes that equals
one of them is taken as that one (its ``Entry`` objects): a receiver in the sender's
process then finds the table cached by identity, not by comparing every entry."""


def pack_entries(entries: tuple[Entry, ...]) -> bytes:
    return b"".join([pack_entry(e) for e in entries])


pack_table = functools.lru_cache(maxsize=TABLE_CACHE)(pack_entries)


_parsed: dict[tuple[bytes, int], tuple[Entry, ...]] = {}
"""Full entry tables read before, by their bytes and entry count (at most
``TABLE_CACHE``)."""


def full_table(table: bytes, count: int, read: Callable[[], tuple[Entry, ...]]
               ) -> tuple[Entry, ...]:
    """The ``count`` entries of a full payload's ``table``: one read before (``_parsed``),
    else ``read()``'s, or the equal table this process built (``_built``)."""
    key = (table, count)
    entries = _parsed.get(key)
    if entries is None:
        fresh = read()
        entries = _built.get(fresh, fresh)
        if len(_parsed) >= TABLE_CACHE:
            _parsed.pop(next(iter(_parsed)), None)  # oldest first
        _parsed[key] = entries
    return entries


def pack_entry(entry: Entry) -> bytes:
    name = entry.name.encode()
    return _entry_struct(len(name), len(entry.shape)).pack(
        len(name), name, DTYPE_CODES[entry.dtype], len(entry.shape), entry.index_encoding,
        entry.value_encoding, entry.index_width, entry.value_width, 0, entry.count,
        entry.index_escapes, entry.value_escapes, *entry.shape)


@functools.lru_cache(maxsize=4096)
def _entry_struct(name_bytes: int, ndim: int) -> struct.Struct:
    """An entry's name length, name, fields and dimensions, in one struct."""
    return struct.Struct(f"{NAME_LENGTH.format}{name_bytes}s{ENTRY_FIELDS.format[1:]}"
                         f"{ndim}{SHAPE_DIM.format[1:]}")



_skeletons: dict[tuple[int, int], Skeleton] = {}
"""The skeletons of the delta tables read last, by table size and entry count (at most
``TABLE_CACHE``): a stream's next delta is read through its stream's one."""


def by_skeleton(table: bytes, count: int) -> Entries | None:
    """The entries of a delta's ``table`` read through the skeleton kept for its size and
    count; None where there is none or it does not hold the table."""
    from .table_skeleton import Entries
    skeleton = _skeletons.get((len(table), count))
    columns = None if skeleton is None else skeleton.read(table)
    return None if columns is None else Entries(skeleton, columns)


def keep_skeleton(entries: tuple[Entry, ...], table: bytes) -> tuple[Entry, ...] | Entries:
    """Keep the skeleton of a delta's ``table``, read field by field into ``entries``;
    return the entries as read through it (``entries`` where it cannot hold them)."""
    from .table_skeleton import Entries, Skeleton
    if not Skeleton.holds(entries):
        return entries
    key = (len(table), len(entries))
    _skeletons.pop(key, None)
    if len(_skeletons) >= TABLE_CACHE:
        _skeletons.pop(next(iter(_skeletons)))  # oldest first
    skeleton = _skeletons[key] = Skeleton(entries, table)
    columns = skeleton.read(table)
    return entries if columns is None else Entries(skeleton, columns, made=entries)


@functools.cache
def _dims(ndim: int) -> struct.Struct:
    return struct.Struct(f"<{ndim}Q")


def read_table(table: bytes, count: int) -> tuple[Entry, ...] | None:
    """The ``count`` entries that exactly fill ``table``, read in one pass without a
    bounds check per field; ``None`` where ``_Reader.entry`` would raise (it is then
    asked, to say why)."""
    entries, pos, unpack = [], 0, ENTRY_FIELDS.unpack_from
    try:
        for _ in range(count):
            name_at = pos + NAME_LENGTH.size
            fields_at = name_at + NAME_LENGTH.unpack_from(table, pos)[0]
            (dtype, ndim, index_enc, value_enc, index_width, value_width, reserved, n,
             index_esc, value_esc) = unpack(table, fields_at)
            if dtype not in DTYPES or reserved or ndim > MAX_NDIM:
                return None
            pos = fields_at + ENTRY_FIELDS.size
            shape = _dims(ndim).unpack_from(table, pos)
            pos += SHAPE_DIM.size * ndim
            index_encoding = INDEX_ENCODINGS.get(index_enc)
            value_encoding = VALUE_ENCODINGS.get(value_enc)
            if index_encoding is None or value_encoding is None or (
                    shape and max(shape) >= SIZE_LIMIT):
                return None
            entries.append(Entry(
                name=table[name_at:fields_at].decode(),
                dtype=DTYPES[dtype], shape=shape, count=n, index_encoding=index_encoding,
                index_width=index_width, index_escapes=index_esc,
                value_encoding=value_encoding, value_width=value_width,
                value_escapes=value_esc))
    except (struct.error, UnicodeDecodeError):
        return None
    return tuple(entries) if pos == len(table) else None
