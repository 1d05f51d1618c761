"""The smallest encodings of every tensor at once, from its sizes and statistics.

Each choice is the reference encoder's, computed with a few numpy ops over all tensors
instead of Python per tensor: ``choose_indices`` and ``choose_values`` (the one-tensor
case, which ``indices.encode_indices`` and ``values.encode_values`` call) pick the
smallest encoding with the reference's tie order. Candidate sizes that need only the
change counts (``IndexSizes``, ``ValueSizes``) are computed before the statistics arrive
(``encode_plan.prepare``), leaving comparisons for after.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import torch

from .bits import BYTE_BITS, ceil_bytes
from .encodings import (BITMAP, ELIAS_FANO, GAP8, INDEX32_LIMIT, INDEX_ENCODINGS, INT32, INT64,
                        RAW, RESIDUE, RESIDUE_DTYPES, IndexEncoding, ValueEncoding,
                        index_itemsizes)

_NONE = np.iinfo(np.int64).max
"""The size of a candidate that is not allowed."""
_POWERS = np.left_shift(np.int64(1), np.arange(63, dtype=np.int64))

def _bit_length(x: np.ndarray) -> np.ndarray:
    """Bits needed for each non-negative int64 (0 for 0), without floating point: how
    many powers of two are at most ``x``."""
    return np.searchsorted(_POWERS, x, side="right")


@attrs.frozen
class IndexChoice:
    encoding: np.ndarray
    width: np.ndarray
    escapes: np.ndarray


@attrs.frozen
class ValueChoice:
    encoding: np.ndarray
    width: np.ndarray
    escapes: np.ndarray


@attrs.frozen
class IndexSizes:
    """Per tensor, what its index encodings cost from its count and numel alone: every
    candidate but GAP8 (whose size needs the gaps over a byte), so that only a comparison
    is left once the statistics arrive."""

    count: np.ndarray
    itemsize: np.ndarray
    """Index itemsize of the tensor's numel (INT32 or INT64)."""
    low: np.ndarray
    """Elias-Fano low bits."""
    encoding: np.ndarray
    """The first smallest of raw, Elias-Fano and bitmap."""
    gap_limit: np.ndarray
    """GAP8 wins when its size is below this: it must beat raw strictly (raw comes
    first), and tie Elias-Fano and bitmap (it comes before them)."""
    upper_bytes: np.ndarray
    """Bytes of the Elias-Fano upper bits (its second section)."""
    by_encoding: np.ndarray
    """``(BY_ENCODING, encodings, tensors)``: per encoding value, the first section's
    bytes, the layout's ``width`` and ``stride`` of its fields and whether it has a
    second section (the plan reads a sparse entry's with one gather); DENSE's unused."""

    BY_ENCODING = ("first_bytes", "width", "stride", "two_sections")

    @classmethod
    def of(cls, count: np.ndarray, numel: np.ndarray) -> IndexSizes:
        size = index_itemsizes(numel)
        raw = count * size
        low = np.maximum(_bit_length(numel // np.maximum(count, 1)) - 1, 0)
        upper_bytes = ceil_bytes(count + ((numel - 1) >> low) + 1)
        low_bytes, map_bytes = ceil_bytes(count * low), ceil_bytes(numel)
        ef = low_bytes + upper_bytes
        bitmap = np.where(numel <= BYTE_BITS * raw, map_bytes, _NONE)
        other = np.minimum(ef, bitmap)
        raw_wins = raw <= other
        encoding = np.where(raw_wins, np.where(numel < INDEX32_LIMIT, INT32, INT64),
                            np.where(ef <= bitmap, ELIAS_FANO, BITMAP))
        raw_bits = size * BYTE_BITS
        by_encoding = np.zeros((len(cls.BY_ENCODING), len(IndexEncoding), len(count)),
                               np.int64)
        first, width, stride, two_sections = by_encoding
        first[[INT32, INT64]], width[[INT32, INT64]] = raw, raw_bits
        stride[[INT32, INT64]] = raw_bits
        first[BITMAP], width[BITMAP] = map_bytes, 1  # a bit at each index: stride 0
        first[GAP8], width[GAP8], stride[GAP8] = count, BYTE_BITS, BYTE_BITS
        first[ELIAS_FANO], width[ELIAS_FANO], stride[ELIAS_FANO] = low_bytes, low, low
        two_sections[[GAP8, ELIAS_FANO]] = 1
        return cls(count, size, low, encoding, np.where(raw_wins, raw, other + 1), upper_bytes,
                   by_encoding)

    def choose(self, gap_escapes: np.ndarray) -> IndexChoice:
        """The smallest encodings, given each tensor's gaps over a byte."""
        gap = self.count + gap_escapes * self.itemsize < self.gap_limit
        encoding = np.where(gap, GAP8, self.encoding)
        return IndexChoice(encoding, np.where(encoding == ELIAS_FANO, self.low, 0),
                           np.where(gap, gap_escapes, 0))


def choose_index_encodings(count: np.ndarray, numel: np.ndarray, *,
                           gap_escapes: np.ndarray) -> IndexChoice:
    """Per tensor, the smallest index encoding from sizes alone; ties go to INT32/INT64,
    then GAP8, then ELIAS_FANO, then BITMAP (the first smallest candidate)."""
    return IndexSizes.of(count, numel).choose(gap_escapes)


@attrs.frozen
class ValueSizes:
    """Per tensor, what its value encodings cost apart from the histogram: the raw size,
    and per residue width what an escape costs and whether the width is narrower than
    the dtype."""

    count: np.ndarray
    residue: np.ndarray
    raw: np.ndarray
    width: np.ndarray
    """The residue widths tried, ``1..bins-1`` (a row)."""
    position_size: np.ndarray
    """Bytes of an escape's position (the count's index itemsize)."""
    escape: np.ndarray
    """Bytes of one escape (position and raw value), a column."""
    escaped_all: np.ndarray
    """Bytes of every value escaped, a column."""
    barred: np.ndarray | None
    """The widths not narrower than the dtype (rows: tensors); None when there are none."""
    rows: np.ndarray
    """``0..tensors-1``."""

    @classmethod
    def of(cls, count: np.ndarray, itemsize: np.ndarray, residue: np.ndarray,
           bins: int) -> ValueSizes:
        width = np.arange(1, max(bins, 1), dtype=np.int64)
        position_size = index_itemsizes(count)
        escape = (position_size + itemsize)[:, None]
        barred = width >= itemsize[:, None] * BYTE_BITS
        return cls(count, residue, count * itemsize, width, position_size, escape,
                   count[:, None] * escape, barred if barred.any() else None,
                   np.arange(len(count)))

    def choose(self, hist: np.ndarray) -> ValueChoice:
        """RESIDUE at the width that makes the values smallest (the narrowest on a tie),
        or RAW when no width beats raw values or the dtype has no residues; ``hist``:
        per tensor (rows), how many values need each residue width ``0..bins-1``."""
        count = self.count
        if not len(self.width):
            zero = np.zeros_like(count)
            return ValueChoice(np.full_like(count, RAW), zero, zero)
        covered = np.cumsum(hist[:, 1:], axis=1)
        sizes = ceil_bytes(covered * self.width) + (self.escaped_all - covered * self.escape)
        if self.barred is not None:
            sizes[self.barred] = _NONE
        at = sizes.argmin(1)
        chosen = self.residue & (sizes[self.rows, at] < self.raw)
        escapes = count - hist[:, 0] - covered[self.rows, at]
        return ValueChoice(np.where(chosen, RESIDUE, RAW), np.where(chosen, at + 1, 0),
                           np.where(chosen, escapes, 0))


def choose_value_encodings(count: np.ndarray, itemsize: np.ndarray, residue: np.ndarray,
                           hist: np.ndarray) -> ValueChoice:
    """Per tensor (rows of ``hist``: how many values need each residue width), RESIDUE at
    the width that makes the values smallest (the narrowest on a tie), or RAW when no
    width beats raw values or the dtype has no residues."""
    return ValueSizes.of(count, itemsize, residue, hist.shape[1]).choose(hist)


def choose_indices(count: int, numel: int, *, gap_escapes: int) -> dict[str, object]:
    """Header fields of the smallest index encoding of one tensor
    (``choose_index_encodings``)."""
    c = choose_index_encodings(np.array([count]), np.array([numel]),
                               gap_escapes=np.array([gap_escapes]))
    return {"index_encoding": INDEX_ENCODINGS[int(c.encoding[0])], "index_width": int(c.width[0]),
            "index_escapes": int(c.escapes[0])}


def choose_values(count: int, dtype: torch.dtype, itemsize: int,
                  hist: Sequence[int]) -> dict[str, object]:
    """Header fields of the smallest value encoding of one tensor, from the histogram of
    the residue width each value needs (``choose_value_encodings``); empty for RAW."""
    if dtype not in RESIDUE_DTYPES:
        return {}
    row = np.zeros((1, max(len(hist), itemsize * BYTE_BITS)), dtype=np.int64)
    row[0, :len(hist)] = hist
    c = choose_value_encodings(np.array([count]), np.array([itemsize]), np.array([True]), row)
    if c.encoding[0] == RAW:
        return {}
    return {"value_encoding": ValueEncoding.RESIDUE, "value_width": int(c.width[0]),
            "value_escapes": int(c.escapes[0])}
