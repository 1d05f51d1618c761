"""The self-describing payload header: prelude, stream identity, versions, entry table.

Layout, byte order and validation order are specified in ``FORMAT.md``; this module is
its only implementation. ``Header.pack`` and ``Header.unpack`` are exact inverses.
"""

from __future__ import annotations

import enum
import functools
import math
import numbers
import struct

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np
import torch
import xxhash

from .errors import DigestError, HeaderError

if TYPE_CHECKING:
    import numpy as np

    from .entry_table import EntryTable, Sections
    from .table_skeleton import Entries, Skeleton

MAGIC = b"DTEP"
CODEC_VERSION = 3
ALIGNMENT = 8
NO_BASE = -1
MAX_NDIM = 16
MAX_NAME_BYTES = 65535
INDEX32_LIMIT = 2**31
"""Tensors with fewer elements than this use int32 indices and escape lists."""

_PRELUDE = struct.Struct("<4sHBBIIqqQQHQ")
DIGEST_OFFSET = struct.calcsize("<4sHBBIIqqQ")
"""Byte offset of the 8-byte header digest field inside the prelude."""
BODY_DIGEST_OFFSET = struct.calcsize("<4sHBBIIqqQQH")
"""Byte offset of the 8-byte body digest field inside the prelude."""
_HEADER_LENGTH = struct.Struct("<I")
_HEADER_LENGTH_OFFSET = 8
_NAME_LENGTH = struct.Struct("<H")
_ENTRY_FIELDS = struct.Struct("<BBBBBBHQQQ")
_DIM = struct.Struct("<Q")

DTYPES: dict[int, torch.dtype] = {
    1: torch.bfloat16,
    2: torch.float16,
    3: torch.float32,
    4: torch.float64,
    5: torch.int8,
    6: torch.uint8,
    7: torch.int16,
    8: torch.int32,
    9: torch.int64,
    10: torch.bool,
}
DTYPE_CODES = {dtype: code for code, dtype in DTYPES.items()}
RESIDUE_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})
"""Payload dtypes whose values may be coded as residues against the receiver's base."""


class Kind(enum.IntEnum):
    FULL = 0
    DELTA = 1


class IndexEncoding(enum.IntEnum):
    DENSE = 0
    INT32 = 1
    INT64 = 2
    BITMAP = 3
    GAP8 = 4
    ELIAS_FANO = 5
    BOX = 6
    """A dense unit-step box of the tensor: its start and size, then its values."""


BOX_FIELD_BYTES = 8
"""Each of a box's ``2 * ndim`` coordinates (start, then size) is a u64."""


class ValueEncoding(enum.IntEnum):
    RAW = 0
    RESIDUE = 1


def align(size: int) -> int:
    return -(-size // ALIGNMENT) * ALIGNMENT


def index_itemsize(limit: int) -> int:
    """Bytes per index or position into a sequence of ``limit`` elements."""
    return 4 if limit < INDEX32_LIMIT else 8


def index_itemsizes(limits: np.ndarray) -> np.ndarray:
    """``index_itemsize`` of every limit in an array."""
    return np.where(limits < INDEX32_LIMIT, 4, 8)


@attrs.frozen(kw_only=True, cache_hash=True)
class Entry:
    """One tensor of a payload: what it is and how its sections are encoded.

    Hashable (cached): the header caches below are keyed by entries, since a stream
    sends the same table of contents sync after sync.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    count: int
    """Number of elements carried (numel for dense entries)."""
    index_encoding: IndexEncoding = IndexEncoding.DENSE
    index_width: int = 0
    """Low-bit width of Elias-Fano indices; 0 otherwise."""
    index_escapes: int = 0
    """Number of gaps too large for one byte (GAP8 only)."""
    value_encoding: ValueEncoding = ValueEncoding.RAW
    value_width: int = 0
    """Residue width in bits (RESIDUE only)."""
    value_escapes: int = 0
    """Number of values sent raw because their residue would not fit (RESIDUE only)."""

    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def section_sizes(self) -> tuple[int, ...]:
        """Unpadded byte sizes of this entry's body sections, in body order."""
        return self._sizes

    @functools.cached_property
    def _sizes(self) -> tuple[int, ...]:
        return self.index_sections() + self.value_sections()

    @functools.cached_property
    def body_bytes(self) -> int:
        """Bytes of this entry's sections in the body, each padded to the alignment."""
        return sum(align(size) for size in self._sizes)

    def index_sections(self) -> tuple[int, ...]:
        n, numel, enc = self.count, self.numel, self.index_encoding
        isz = index_itemsize(numel)
        if enc == IndexEncoding.DENSE:
            return ()
        if enc in (IndexEncoding.INT32, IndexEncoding.INT64):
            return (n * (4 if enc == IndexEncoding.INT32 else 8),)
        if enc == IndexEncoding.BITMAP:
            return (-(-numel // 8),)
        if enc == IndexEncoding.BOX:
            return (2 * len(self.shape) * BOX_FIELD_BYTES,)
        if enc == IndexEncoding.GAP8:
            return (n, self.index_escapes * isz)
        upper_bits = n + ((max(numel, 1) - 1) >> self.index_width) + 1
        return (-(-n * self.index_width // 8), -(-upper_bits // 8))

    def value_sections(self) -> tuple[int, ...]:
        n, itemsize = self.count, self.itemsize
        if self.value_encoding == ValueEncoding.RAW:
            return (n * itemsize,)
        fields = n - self.value_escapes
        esc = self.value_escapes
        return (-(-fields * self.value_width // 8), esc * index_itemsize(n), esc * itemsize)

    def validate(self, kind: Kind) -> None:
        """Check the entry's fields against each other; raise ``HeaderError`` naming the field."""
        _check(self.name, "ndim", f"<= {MAX_NDIM}", len(self.shape), len(self.shape) <= MAX_NDIM)
        _check(self.name, "numel", "< 2**62", self.numel, self.numel < 2**62)
        _check(self.name, "count", f"<= numel {self.numel}", self.count, self.count <= self.numel)
        dense = self.index_encoding == IndexEncoding.DENSE
        block = dense or self.index_encoding == IndexEncoding.BOX
        _check(self.name, "index_encoding", "DENSE or BOX in a full payload",
               self.index_encoding.name, block or kind == Kind.DELTA)
        _check(self.name, "count", f"numel {self.numel} for a dense entry", self.count,
               not dense or self.count == self.numel)
        _check(self.name, "count", ">= 1 for a sparse or box entry", self.count,
               dense or self.count >= 1)
        _check(self.name, "value_encoding", "RAW for a dense or box entry",
               self.value_encoding.name, not block or self.value_encoding == ValueEncoding.RAW)
        _check(self.name, "index_encoding", "INT64 for a tensor of >= 2**31 elements",
               self.index_encoding.name,
               self.index_encoding != IndexEncoding.INT32 or self.numel < INDEX32_LIMIT)
        gap = self.index_encoding == IndexEncoding.GAP8
        _check(self.name, "index_escapes", f"0..{self.count} (GAP8 only)", self.index_escapes,
               self.index_escapes <= self.count and (gap or self.index_escapes == 0))
        ef = self.index_encoding == IndexEncoding.ELIAS_FANO
        _check(self.name, "index_width", "0..62 (ELIAS_FANO only)", self.index_width,
               self.index_width <= 62 and (ef or self.index_width == 0))
        self._validate_values()

    def _validate_values(self) -> None:
        residue = self.value_encoding == ValueEncoding.RESIDUE
        _check(self.name, "value_encoding", "RAW for dtype " + str(self.dtype),
               self.value_encoding.name, not residue or self.dtype in RESIDUE_DTYPES)
        max_width = self.itemsize * 8 - 1
        _check(self.name, "value_width", f"1..{max_width} (RESIDUE only)", self.value_width,
               (1 <= self.value_width <= max_width) if residue else self.value_width == 0)
        _check(self.name, "value_escapes", f"0..{self.count} (RESIDUE only)", self.value_escapes,
               self.value_escapes <= self.count and (residue or self.value_escapes == 0))


def _check(tensor: str | None, field: str, expected: object, got: object, ok: bool) -> None:
    if not ok:
        raise HeaderError(field, expected=expected, got=got, tensor=tensor)


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
        return (_entry_table if self.kind == Kind.FULL else _new_table)(self.entries)

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
        _check(None, "stream_id", f"<= {MAX_NAME_BYTES} UTF-8 bytes",
               len(self.stream_id.encode()), len(self.stream_id.encode()) <= MAX_NAME_BYTES)
        _check(None, "payload_version", "0..2**63-1", self.payload_version,
               isinstance(self.payload_version, numbers.Integral)
               and 0 <= self.payload_version < 2**63)
        if self.kind == Kind.FULL:
            _check(None, "base_version", f"{NO_BASE} for a full payload", self.base_version,
                   self.base_version == NO_BASE)
        else:
            _check(None, "base_version", f"0..{self.payload_version - 1} for a delta",
                   self.base_version, isinstance(self.base_version, numbers.Integral)
                   and 0 <= self.base_version < self.payload_version)
        if self.entries:  # an encoder checks its fields alone, then packs its own table
            self._table.validate(self.kind)

    def pack(self) -> bytes:
        """Header bytes with zero digest fields, padded to the body's alignment."""
        table = (_pack_table if self.kind == Kind.FULL else _pack_entries)(self.entries)
        return pack_head(self, entries=len(self.entries), table=table,
                         body_size=self.body_size())

    @classmethod
    def unpack(cls, data: memoryview) -> tuple[Header, int]:
        """Parse and validate the header of a whole payload in ``data``; return it with
        the body's offset in ``data``."""
        return _Reader(data, len(data)).header()

    @classmethod
    def unpack_head(cls, head: memoryview, body_size: int) -> Header:
        """Parse and validate ``head``, exactly the header bytes of a payload whose body
        (held elsewhere, e.g. on a device) has ``body_size`` bytes."""
        header, offset = _Reader(head, len(head) + body_size).header()
        _check(None, "header bytes", offset, len(head), offset == len(head))
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


def body_digest_of(head: bytes | bytearray | memoryview) -> int:
    """The body digest a packed header carries."""
    return struct.unpack_from("<Q", head, BODY_DIGEST_OFFSET)[0]


TABLE_CACHE = 8
"""Entry tables remembered (packed, parsed, validated): a stream sends the same table
sync after sync, a receiver may serve a few streams; each costs O(entries) once."""


def _new_table(entries: tuple[Entry, ...]) -> EntryTable:
    from .entry_table import EntryTable  # it reads this module's Entry and enums

    return EntryTable(entries)


@functools.lru_cache(maxsize=TABLE_CACHE)
def _entry_table(entries: tuple[Entry, ...]) -> EntryTable:
    _built[entries] = entries
    if len(_built) > TABLE_CACHE:
        _built.pop(next(iter(_built)))
    return _new_table(entries)


_built: dict[tuple[Entry, ...], tuple[Entry, ...]] = {}
"""The full tables given to ``_entry_table`` lately. A table read from bytes that equals
one of them is taken as that one (its ``Entry`` objects): a receiver in the sender's
process then finds the table cached by identity, not by comparing every entry."""


def _pack_entries(entries: tuple[Entry, ...]) -> bytes:
    return b"".join([_pack_entry(e) for e in entries])


_pack_table = functools.lru_cache(maxsize=TABLE_CACHE)(_pack_entries)


_parsed_tables: dict[tuple[bytes, int], tuple[Entry, ...]] = {}
"""Full entry tables read before, by their bytes and entry count (at most
``TABLE_CACHE``)."""


def _pack_entry(entry: Entry) -> bytes:
    name = entry.name.encode()
    return _entry_struct(len(name), len(entry.shape)).pack(
        len(name), name, DTYPE_CODES[entry.dtype], len(entry.shape), entry.index_encoding,
        entry.value_encoding, entry.index_width, entry.value_width, 0, entry.count,
        entry.index_escapes, entry.value_escapes, *entry.shape)


@functools.lru_cache(maxsize=4096)
def _entry_struct(name_bytes: int, ndim: int) -> struct.Struct:
    """An entry's name length, name, fields and dimensions, in one struct."""
    return struct.Struct(f"{_NAME_LENGTH.format}{name_bytes}s{_ENTRY_FIELDS.format[1:]}"
                         f"{ndim}{_DIM.format[1:]}")


class _Reader:
    """Bounds-checked sequential reader; every failure is a ``HeaderError``."""

    def __init__(self, data: memoryview, total: int):
        self.data = data
        self.total = total
        """Bytes of the whole payload: ``data`` and any body held elsewhere."""
        self.pos = 0

    def take(self, size: int, what: str) -> memoryview:
        end = self.pos + size
        _check(None, what, f"{size} bytes at offset {self.pos}", f"{len(self.data)} bytes in all",
               end <= len(self.data))
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
        _check(None, "magic", MAGIC, magic, magic == MAGIC)
        _check(None, "codec_version", CODEC_VERSION, version, version == CODEC_VERSION)
        _check(None, "reserved", 0, reserved, reserved == 0)
        _check(None, "header_length", f"{_PRELUDE.size}..{len(self.data)}", length,
               _PRELUDE.size <= length <= len(self.data))
        total = align(length) + body
        _check(None, "payload size", f"{total} bytes (header + body)", self.total,
               total == self.total)
        stored = struct.unpack_from("<Q", self.data, DIGEST_OFFSET)[0]
        if stored != header_digest(self.data):
            raise DigestError("digest", expected=f"{header_digest(self.data):#018x}",
                              got=f"{stored:#018x}")
        kind = self.enum(Kind, kind, "kind", None)
        self.data = self.data[:length]
        stream = self.text(n_stream, "stream_id")
        entries = self.entries(n_entries, kind)
        header = Header(stream_id=stream, kind=kind, base_version=base, payload_version=payload,
                        entries=entries)
        header.validate()
        _check(None, "body_length", header.body_size(), body, header.body_size() == body)
        return header, align(length)

    def entries(self, count: int, kind: Kind) -> tuple[Entry, ...] | Entries:
        """The ``count`` entries filling the rest of a header of ``kind``. A full table
        read before is taken from ``_parsed_tables`` (one dictionary look-up instead of
        O(entries) work; one equal to a table this process built, from ``_built``). A
        delta's table, new each sync (its counts move), is read through the skeleton of
        the stream's previous one, else field by field, its skeleton then kept."""
        table = bytes(self.data[self.pos:])
        if kind == Kind.DELTA:
            entries = _by_skeleton(table, count)
            if entries is None:
                entries = _keep_skeleton(self._read(table, count), table)
        else:
            key = (table, count)
            entries = _parsed_tables.get(key)
            if entries is None:
                read = self._read(table, count)
                entries = _built.get(read, read)
                if len(_parsed_tables) >= TABLE_CACHE:
                    _parsed_tables.pop(next(iter(_parsed_tables)), None)  # oldest first
                _parsed_tables[key] = entries
        self.pos = len(self.data)
        return entries

    def _read(self, table: bytes, count: int) -> tuple[Entry, ...]:
        """The entries of ``table``, read field by field (``HeaderError`` naming the first
        wrong one)."""
        entries = _read_table(table, count)
        if entries is None:  # some field is wrong: the field by field reading names it
            entries = tuple(self.entry() for _ in range(count))
            _check(None, "header_length", self.pos, len(self.data), self.pos == len(self.data))
        return entries

    def entry(self) -> Entry:
        (n_name,) = _NAME_LENGTH.unpack(self.take(_NAME_LENGTH.size, "entry name length"))
        name = self.text(n_name, "entry name")
        (dtype, ndim, index_enc, value_enc, index_width, value_width, reserved, count,
         index_esc, value_esc) = _ENTRY_FIELDS.unpack(self.take(_ENTRY_FIELDS.size, "entry fields"))
        _check(name, "dtype", f"one of {sorted(DTYPES)}", dtype, dtype in DTYPES)
        _check(name, "reserved", 0, reserved, reserved == 0)
        _check(name, "ndim", f"<= {MAX_NDIM}", ndim, ndim <= MAX_NDIM)
        shape = tuple(_DIM.unpack(self.take(_DIM.size, "shape"))[0] for _ in range(ndim))
        _check(name, "shape", "dimensions < 2**62", shape, all(d < 2**62 for d in shape))
        return Entry(name=name, dtype=DTYPES[dtype], shape=shape, count=count,
                     index_encoding=self.enum(IndexEncoding, index_enc, "index_encoding", name),
                     index_width=index_width, index_escapes=index_esc,
                     value_encoding=self.enum(ValueEncoding, value_enc, "value_encoding", name),
                     value_width=value_width, value_escapes=value_esc)


_skeletons: dict[tuple[int, int], Skeleton] = {}
"""The skeletons of the delta tables read last, by table size and entry count (at most
``TABLE_CACHE``): a stream's next delta is read through its stream's one."""


def _by_skeleton(table: bytes, count: int) -> Entries | None:
    """The entries of a delta's ``table`` read through the skeleton kept for its size and
    count; None where there is none or it does not hold the table."""
    from .table_skeleton import Entries
    skeleton = _skeletons.get((len(table), count))
    columns = None if skeleton is None else skeleton.read(table)
    return None if columns is None else Entries(skeleton, columns)


def _keep_skeleton(entries: tuple[Entry, ...], table: bytes) -> tuple[Entry, ...] | Entries:
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


_INDEX_ENCODINGS = {m.value: m for m in IndexEncoding}
_VALUE_ENCODINGS = {m.value: m for m in ValueEncoding}


@functools.cache
def _dims(ndim: int) -> struct.Struct:
    return struct.Struct(f"<{ndim}Q")


def _read_table(table: bytes, count: int) -> tuple[Entry, ...] | None:
    """The ``count`` entries that exactly fill ``table``, read in one pass without a
    bounds check per field; ``None`` where ``_Reader.entry`` would raise (it is then
    asked, to say why)."""
    entries, pos, unpack = [], 0, _ENTRY_FIELDS.unpack_from
    try:
        for _ in range(count):
            name_at = pos + _NAME_LENGTH.size
            fields_at = name_at + _NAME_LENGTH.unpack_from(table, pos)[0]
            (dtype, ndim, index_enc, value_enc, index_width, value_width, reserved, n,
             index_esc, value_esc) = unpack(table, fields_at)
            if dtype not in DTYPES or reserved or ndim > MAX_NDIM:
                return None
            pos = fields_at + _ENTRY_FIELDS.size
            shape = _dims(ndim).unpack_from(table, pos)
            pos += _DIM.size * ndim
            index_encoding = _INDEX_ENCODINGS.get(index_enc)
            value_encoding = _VALUE_ENCODINGS.get(value_enc)
            if index_encoding is None or value_encoding is None or (
                    shape and max(shape) >= 2**62):
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
