"""The codec's wire codes and sizes: dtype codes, payload kinds, index and value encodings,
the body's alignment and the width of indices.

``FORMAT.md`` specifies them; the header (``header``), its entries (``entry``) and the
sections of a body read them from here.
"""

from __future__ import annotations

import enum

import numpy as np
import torch

ALIGNMENT = 8
MAX_NDIM = 16
SIZE_LIMIT = 2**62
"""Tensors have fewer elements than this, and dimensions of fewer: their sizes, and sums
of a few of them, stay far inside int64."""
INDEX32_LIMIT = 2**31
"""Tensors with fewer elements than this use int32 indices and escape lists."""

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


INDEX_ENCODINGS = {int(e): e for e in IndexEncoding}
VALUE_ENCODINGS = {int(e): e for e in ValueEncoding}
"""Each encoding by its code: a dict look-up, where calling the enum costs more per
entry of a table."""

DENSE, INT32, INT64, BITMAP, GAP8, ELIAS_FANO, BOX = (
    int(IndexEncoding[name]) for name in
    ("DENSE", "INT32", "INT64", "BITMAP", "GAP8", "ELIAS_FANO", "BOX"))
RAW, RESIDUE = int(ValueEncoding.RAW), int(ValueEncoding.RESIDUE)
"""The codes as plain ints, for the column arithmetic over whole tables: numpy compares
an array with an int ten times faster than with an ``IntEnum`` member, and reading a
member is a class attribute look-up that costs more than the comparison it feeds."""


def align(size: int) -> int:
    return -(-size // ALIGNMENT) * ALIGNMENT


def index_itemsize(limit: int) -> int:
    """Bytes per index or position into a sequence of ``limit`` elements."""
    return 4 if limit < INDEX32_LIMIT else 8


def index_itemsizes(limits: np.ndarray) -> np.ndarray:
    """``index_itemsize`` of every limit in an array."""
    return np.where(limits < INDEX32_LIMIT, 4, 8)
