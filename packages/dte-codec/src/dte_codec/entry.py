"""One tensor of a payload (``Entry``): its identity, its encodings and the byte sizes
of its body sections, and the checks of its fields against each other (``FORMAT.md``).
"""

from __future__ import annotations

import functools
import math

import attrs
import torch

from .encodings import (BOX_FIELD_BYTES, INDEX32_LIMIT, MAX_NDIM, RESIDUE_DTYPES, SIZE_LIMIT,
                        IndexEncoding, Kind, ValueEncoding, align, index_itemsize)
from .errors import HeaderError


@attrs.frozen(kw_only=True, cache_hash=True)
class Entry:
    """One tensor of a payload: what it is and how its sections are encoded.

    Hashable (cached): the header caches (``table_bytes``) are keyed by entries, since a stream
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
        check_field(self.name, "ndim", f"<= {MAX_NDIM}", len(self.shape),
                    len(self.shape) <= MAX_NDIM)
        check_field(self.name, "numel", "< 2**62", self.numel, self.numel < SIZE_LIMIT)
        check_field(self.name, "count", f"<= numel {self.numel}", self.count,
                    self.count <= self.numel)
        dense = self.index_encoding == IndexEncoding.DENSE
        block = dense or self.index_encoding == IndexEncoding.BOX
        check_field(self.name, "index_encoding", "DENSE or BOX in a full payload",
                    self.index_encoding.name, block or kind == Kind.DELTA)
        check_field(self.name, "count", f"numel {self.numel} for a dense entry", self.count,
                    not dense or self.count == self.numel)
        check_field(self.name, "count", ">= 1 for a sparse or box entry", self.count,
                    dense or self.count >= 1)
        check_field(self.name, "value_encoding", "RAW for a dense or box entry",
                    self.value_encoding.name, not block or self.value_encoding == ValueEncoding.RAW)
        check_field(self.name, "index_encoding", "INT64 for a tensor of >= 2**31 elements",
                    self.index_encoding.name,
                    self.index_encoding != IndexEncoding.INT32 or self.numel < INDEX32_LIMIT)
        gap = self.index_encoding == IndexEncoding.GAP8
        check_field(self.name, "index_escapes", f"0..{self.count} (GAP8 only)", self.index_escapes,
                    self.index_escapes <= self.count and (gap or self.index_escapes == 0))
        ef = self.index_encoding == IndexEncoding.ELIAS_FANO
        check_field(self.name, "index_width", "0..62 (ELIAS_FANO only)", self.index_width,
                    self.index_width <= 62 and (ef or self.index_width == 0))
        self._validate_values()

    def _validate_values(self) -> None:
        residue = self.value_encoding == ValueEncoding.RESIDUE
        check_field(self.name, "value_encoding", "RAW for dtype " + str(self.dtype),
                    self.value_encoding.name, not residue or self.dtype in RESIDUE_DTYPES)
        max_width = self.itemsize * 8 - 1
        check_field(self.name, "value_width", f"1..{max_width} (RESIDUE only)", self.value_width,
                    (1 <= self.value_width <= max_width) if residue else self.value_width == 0)
        check_field(self.name, "value_escapes", f"0..{self.count} (RESIDUE only)",
                    self.value_escapes,
                    self.value_escapes <= self.count and (residue or self.value_escapes == 0))


def check_field(tensor: str | None, field: str, expected: object, got: object, ok: bool) -> None:
    if not ok:
        raise HeaderError(field, expected=expected, got=got, tensor=tensor)
