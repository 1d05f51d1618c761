"""The self-describing payload header: prelude, stream identity, versions, entry table.

Layout, byte order and validation order are specified in ``FORMAT.md``; this module, with
the codes (``encodings``), the entries (``entry``) and the table bytes (``table_bytes``) it
reads, is its only implementation. ``Header.pack`` and ``Header.unpack`` are exact inverses.
"""

from __future__ import annotations

import functools
import numbers
import struct

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import xxhash

from .body_digest import U64
from .encodings import DTYPES, MAX_NDIM, SIZE_LIMIT, IndexEncoding, Kind, ValueEncoding, align
from .entry import Entry, check_field
from .errors import DigestError, HeaderError
from .table_bytes import (ENTRY_FIELDS, NAME_LENGTH, SHAPE_DIM, by_skeleton, cached_entry_table,
                          full_table, keep_skeleton, new_table, pack_entries, pack_table,
                          read_table)

if TYPE_CHECKING:
    import numpy as np

    from .entry_table import EntryTable, Sections
    from .table_skeleton import Entries, Skeleton

MAGIC = b"DTEP"
CODEC_VERSION = 3
NO_BASE = -1
MAX_NAME_BYTES = 65535

_PRELUDE = struct.Struct("<4sHBBIIqqQQHQ")
DIGEST_OFFSET = struct.calcsize("<4sHBBIIqqQ")
"""Byte offset of the 8-byte header digest field inside the prelude."""
BODY_DIGEST_OFFSET = struct.calcsize("<4sHBBIIqqQQH")
"""Byte offset of the 8-byte body digest field inside the prelude."""
_HEADER_LENGTH = struct.Struct("<I")
_HEADER_LENGTH_OFFSET = 8


def _entries(entries: Sequence[Entry]) -> tuple[Entry, ...] | Entries:
    from .table_skeleton import Entries
    return entries if isinstance(entries, (tuple, Entries)) else tuple(entries)


@attrs.frozen(kw_only=True)
class Header:
    """Identity and table of contents of one payload, full or delta."""

    stream_id: str
    kind: Kind
    base_version: int
    """The version a delta applies onto; ``NO_BASE`` (-1) for full payloads."""
    payload_version: int
    entries: tuple[Entry, ...] = attrs.field(converter=_entries)
    """The entries; read through a ``table_skeleton.Skeleton``, an ``Entries`` that
    builds each ``Entry`` when first asked for (equal to the tuple of them)."""

    def body_size(self) -> int:
        return self._body_size

    @functools.cached_property
    def _body_size(self) -> int:
        return self._table.sections.body_size

    def sections(self) -> Sections:
        """Every entry's ``section_sizes``, in body order, computed for all at once."""
        return self._table.sections

    def columns(self) -> dict[str, np.ndarray]:
        """The entries' fields as int64 columns (``EntryTable.columns``) of a header that
        passed ``validate``."""
        columns = self._table.columns
        assert columns is not None, "a validated header's fields fit int64"
        return columns

    @functools.cached_property
    def _table(self) -> EntryTable:
        # a delta's table differs from sync to sync: remembering it would cost a hash per
        # entry and never hit
        return (cached_entry_table if self.kind == Kind.FULL else new_table)(self.entries)

    def skeleton(self) -> Skeleton | None:
        """The ``Skeleton`` this header's table was read through (the same object for
        every header of that table shape: its names, dtypes and shapes, in order), or None
        where it was not."""
        from .table_skeleton import Entries
        return self.entries.skeleton if isinstance(self.entries, Entries) else None

    def names(self) -> tuple[str, ...]:
        """The entries' tensor names, in order (from the skeleton, building no entry)."""
        skeleton = self.skeleton()
        return skeleton.names if skeleton is not None else tuple(e.name for e in self.entries)

    def validate(self) -> None:
        """Check header fields and every entry; raise ``HeaderError`` naming the field."""
        check_field(None, "stream_id", f"<= {MAX_NAME_BYTES} UTF-8 bytes",
                    len(self.stream_id.encode()), len(self.stream_id.encode()) <= MAX_NAME_BYTES)
        check_field(None, "payload_version", "0..2**63-1", self.payload_version,
                    isinstance(self.payload_version, numbers.Integral)
                    and 0 <= self.payload_version < 2**63)
        if self.kind == Kind.FULL:
            check_field(None, "base_version", f"{NO_BASE} for a full payload", self.base_version,
                        self.base_version == NO_BASE)
        else:
            check_field(None, "base_version", f"0..{self.payload_version - 1} for a delta",
                        self.base_version, isinstance(self.base_version, numbers.Integral)
                        and 0 <= self.base_version < self.payload_version)
        if self.entries:  # an encoder checks its fields alone, then packs its own table
            self._table.validate(self.kind)

    def pack(self) -> bytes:
        """Header bytes with zero digest fields, padded to the body's alignment."""
        table = (pack_table if self.kind == Kind.FULL else pack_entries)(self.entries)
        return pack_head(self, entries=len(self.entries), table=table,
                         body_size=self.body_size())

    @classmethod
    def unpack(cls, data: memoryview) -> tuple[Header, int]:
        """Parse and validate the header of a whole payload in ``data``; return it with
        the body's offset in ``data``."""
        return _Reader(data, len(data)).header()

    @classmethod
    def unpack_head(cls, head: memoryview, body_size: int, *, sealed: bool = True) -> Header:
        """Parse and validate ``head``, exactly the header bytes of a payload whose body
        (held elsewhere, e.g. on a device) has ``body_size`` bytes. ``sealed=False``: a
        frame's ``head`` whose digests are still queued (``Frame.pending_digest``), handed
        over in the process that packed it, so there is no header digest to check yet."""
        header, offset = _Reader(head, len(head) + body_size, sealed).header()
        check_field(None, "header bytes", offset, len(head), offset == len(head))
        return header


def pack_head(header: Header, *, entries: int, table: bytes, body_size: int) -> bytes:
    """``header.pack()`` with its entry table given as ``entries`` packed entries
    (``table``) and the body size: for an encoder that packs the table itself."""
    stream = header.stream_id.encode()
    length = _PRELUDE.size + len(stream) + len(table)
    prelude = _PRELUDE.pack(MAGIC, CODEC_VERSION, header.kind, 0, length, entries,
                            header.base_version, header.payload_version, body_size, 0,
                            len(stream), 0)
    return (prelude + stream + table).ljust(align(length), b"\0")


def header_digest(data: bytes | bytearray | memoryview) -> int:
    """xxh3-64 of the header at the start of ``data`` (``align(header_length)`` bytes,
    or all of ``data`` if shorter), with its own digest field read as zero."""
    length = _HEADER_LENGTH.unpack_from(data, _HEADER_LENGTH_OFFSET)[0]
    head = memoryview(data)[:align(length)]
    hasher = xxhash.xxh3_64()
    hasher.update(head[:DIGEST_OFFSET])
    hasher.update(bytes(8))
    hasher.update(head[DIGEST_OFFSET + 8:])
    return hasher.intdigest()


def sealed(head: bytes, body_digest: int) -> bytes:
    """``head`` (``Header.pack``'s bytes: digest fields zero) with the body digest
    ``body_digest`` (taken mod 2**64) and then its own digest set."""
    head = bytearray(head)
    struct.pack_into("<Q", head, BODY_DIGEST_OFFSET, body_digest & U64)
    struct.pack_into("<Q", head, DIGEST_OFFSET, header_digest(head))
    return bytes(head)


def body_digest_of(head: bytes | bytearray | memoryview) -> int:
    """The body digest a packed header carries."""
    return struct.unpack_from("<Q", head, BODY_DIGEST_OFFSET)[0]



class _Reader:
    """Bounds-checked sequential reader; every failure is a ``HeaderError``."""

    def __init__(self, data: memoryview, total: int, sealed: bool = True):
        self.data = data
        self.total = total
        """Bytes of the whole payload: ``data`` and any body held elsewhere."""
        self.sealed = sealed
        """Whether the header digest is set, and so checked."""
        self.pos = 0

    def take(self, size: int, what: str) -> memoryview:
        end = self.pos + size
        check_field(None, what, f"{size} bytes at offset {self.pos}",
                    f"{len(self.data)} bytes in all", end <= len(self.data))
        chunk = self.data[self.pos:end]
        self.pos = end
        return chunk

    def text(self, size: int, what: str) -> str:
        raw = bytes(self.take(size, what))
        try:
            return raw.decode()
        except UnicodeDecodeError:
            raise HeaderError(what, expected="UTF-8 text", got=raw[:32]) from None

    def enum(self, cls: type[enum.IntEnum], value: int, field: str, tensor: str | None):
        try:
            return cls(value)
        except ValueError:
            raise HeaderError(field, expected=f"one of {[m.value for m in cls]}", got=value,
                              tensor=tensor) from None

    def header(self) -> tuple[Header, int]:
        (magic, version, kind, reserved, length, n_entries, base, payload, body, _, n_stream, _
         ) = _PRELUDE.unpack(self.take(_PRELUDE.size, "prelude"))
        check_field(None, "magic", MAGIC, magic, magic == MAGIC)
        check_field(None, "codec_version", CODEC_VERSION, version, version == CODEC_VERSION)
        check_field(None, "reserved", 0, reserved, reserved == 0)
        check_field(None, "header_length", f"{_PRELUDE.size}..{len(self.data)}", length,
                    _PRELUDE.size <= length <= len(self.data))
        total = align(length) + body
        check_field(None, "payload size", f"{total} bytes (header + body)", self.total,
                    total == self.total)
        stored = struct.unpack_from("<Q", self.data, DIGEST_OFFSET)[0]
        if self.sealed and stored != header_digest(self.data):
            raise DigestError("digest", expected=f"{header_digest(self.data):#018x}",
                              got=f"{stored:#018x}")
        kind = self.enum(Kind, kind, "kind", None)
        self.data = self.data[:length]
        stream = self.text(n_stream, "stream_id")
        entries = self.entries(n_entries, kind)
        header = Header(stream_id=stream, kind=kind, base_version=base, payload_version=payload,
                        entries=entries)
        header.validate()
        check_field(None, "body_length", header.body_size(), body, header.body_size() == body)
        return header, align(length)

    def entries(self, count: int, kind: Kind) -> tuple[Entry, ...] | Entries:
        """The ``count`` entries filling the rest of a header of ``kind``. A full table
        read before is taken from ``table_bytes.full_table``'s cache (one dictionary
        look-up instead of O(entries) work; one equal to a table this process built). A
        delta's table, new each sync (its counts move), is read through the skeleton of
        the stream's previous one, else field by field, its skeleton then kept."""
        table = bytes(self.data[self.pos:])
        if kind == Kind.DELTA:
            entries = by_skeleton(table, count)
            if entries is None:
                entries = keep_skeleton(self._read(table, count), table)
        else:
            entries = full_table(table, count, lambda: self._read(table, count))
        self.pos = len(self.data)
        return entries

    def _read(self, table: bytes, count: int) -> tuple[Entry, ...]:
        """The entries of ``table``, read field by field (``HeaderError`` naming the first
        wrong one)."""
        entries = read_table(table, count)
        if entries is None:  # some field is wrong: the field by field reading names it
            entries = tuple(self.entry() for _ in range(count))
            check_field(None, "header_length", self.pos, len(self.data), self.pos == len(self.data))
        return entries

    def entry(self) -> Entry:
        (n_name,) = NAME_LENGTH.unpack(self.take(NAME_LENGTH.size, "entry name length"))
        name = self.text(n_name, "entry name")
        (dtype, ndim, index_enc, value_enc, index_width, value_width, reserved, count,
         index_esc, value_esc) = ENTRY_FIELDS.unpack(self.take(ENTRY_FIELDS.size, "entry fields"))
        check_field(name, "dtype", f"one of {sorted(DTYPES)}", dtype, dtype in DTYPES)
        check_field(name, "reserved", 0, reserved, reserved == 0)
        check_field(name, "ndim", f"<= {MAX_NDIM}", ndim, ndim <= MAX_NDIM)
        shape = tuple(SHAPE_DIM.unpack(self.take(SHAPE_DIM.size, "shape"))[0]
                      for _ in range(ndim))
        check_field(name, "shape", "dimensions < 2**62", shape, all(d < SIZE_LIMIT for d in shape))
        return Entry(name=name, dtype=DTYPES[dtype], shape=shape, count=count,
                     index_encoding=self.enum(IndexEncoding, index_enc, "index_encoding", name),
                     index_width=index_width, index_escapes=index_esc,
                     value_encoding=self.enum(ValueEncoding, value_enc, "value_encoding", name),
                     value_width=value_width, value_escapes=value_esc)
