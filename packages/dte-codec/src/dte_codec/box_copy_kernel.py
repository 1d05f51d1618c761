"""A Triton kernel that copies many boxes between tensors in one launch.

A copy moves a box of ``n0 x n1 x length`` elements (its shape without size-1
dimensions, dimensions contiguous on both sides merged, right-aligned to three) from an
entry's values to a local tensor; each side has its own strides, and the i-th element of
one side in row-major order is the i-th of the other. Copies are cut into chunks of whole
rows, or of one long row's columns (a static table), one program per chunk, so no element
searches for its copy and the only divisions are per row. The entries and the tensors are
reached through tables of addresses, one per launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 1024
# columns of the per-copy table
(ENTRY, TENSOR, SOURCE_AT, TARGET_AT, MIDDLE, SOURCE_OUTER, SOURCE_MIDDLE, SOURCE_INNER,
 TARGET_OUTER, TARGET_MIDDLE, TARGET_INNER) = (tl.constexpr(c) for c in range(11))
# columns of the per-chunk table
COPY, FIRST_ROW, ROWS, FIRST_COLUMN, COLUMNS = (tl.constexpr(c) for c in range(5))


@triton.jit
def _at(table, c, rows, row):
    return tl.load(table + c * rows + row)


@triton.jit(do_not_specialize=["chunks", "copies"])
def _copy(chunk_table, chunks, copy_table, copies, entry_addresses, tensor_addresses,
          ITEMSIZE: tl.constexpr, CONTIGUOUS: tl.constexpr, BLOCK: tl.constexpr):
    chunk = tl.program_id(0)
    c = _at(chunk_table, COPY, chunks, chunk)
    source = tl.load(entry_addresses + _at(copy_table, ENTRY, copies, c))
    target = tl.load(tensor_addresses + _at(copy_table, TENSOR, copies, c))
    # one element type per launch: the copy moves items, never converts them
    if ITEMSIZE == 1:
        _rows(source.to(tl.pointer_type(tl.int8)), target.to(tl.pointer_type(tl.int8)),
              chunk_table, chunks, chunk, copy_table, copies, c, CONTIGUOUS, BLOCK)
    elif ITEMSIZE == 2:
        _rows(source.to(tl.pointer_type(tl.int16)), target.to(tl.pointer_type(tl.int16)),
              chunk_table, chunks, chunk, copy_table, copies, c, CONTIGUOUS, BLOCK)
    elif ITEMSIZE == 4:
        _rows(source.to(tl.pointer_type(tl.int32)), target.to(tl.pointer_type(tl.int32)),
              chunk_table, chunks, chunk, copy_table, copies, c, CONTIGUOUS, BLOCK)
    else:
        _rows(source.to(tl.pointer_type(tl.int64)), target.to(tl.pointer_type(tl.int64)),
              chunk_table, chunks, chunk, copy_table, copies, c, CONTIGUOUS, BLOCK)


@triton.jit
def _rows(source, target, chunk_table, chunks, chunk, copy_table, copies, c,
          CONTIGUOUS: tl.constexpr, BLOCK: tl.constexpr):
    """The chunk's rows of copy ``c``, from the typed ``source`` to ``target``;
    ``CONTIGUOUS``: rows are contiguous on both sides (wide, coalesced accesses)."""
    first = _at(chunk_table, FIRST_ROW, chunks, chunk)
    rows = _at(chunk_table, ROWS, chunks, chunk)
    source += _at(copy_table, SOURCE_AT, copies, c)
    target += _at(copy_table, TARGET_AT, copies, c)
    middle = _at(copy_table, MIDDLE, copies, c)
    column = _at(chunk_table, FIRST_COLUMN, chunks, chunk)
    columns = _at(chunk_table, COLUMNS, chunks, chunk)
    source_inner = _at(copy_table, SOURCE_INNER, copies, c)
    target_inner = _at(copy_table, TARGET_INNER, copies, c)
    for r in range(first, first + rows):
        outer = r // middle
        inner = r - outer * middle
        source_row = (outer * _at(copy_table, SOURCE_OUTER, copies, c)
                      + inner * _at(copy_table, SOURCE_MIDDLE, copies, c))
        target_row = (outer * _at(copy_table, TARGET_OUTER, copies, c)
                      + inner * _at(copy_table, TARGET_MIDDLE, copies, c))
        for start in range(column, column + columns, BLOCK):
            k = start + tl.arange(0, BLOCK).to(tl.int64)
            inside = k < column + columns
            if CONTIGUOUS:
                values = tl.load(source + source_row + k, mask=inside)
                tl.store(target + target_row + k, values, mask=inside)
            else:
                values = tl.load(source + source_row + k * source_inner, mask=inside)
                tl.store(target + target_row + k * target_inner, values, mask=inside)


def copy(chunk_table, copy_table, entry_addresses, tensor_addresses, *, itemsize: int,
         contiguous: bool) -> None:
    """One launch over every chunk of ``chunk_table`` (items of ``itemsize`` bytes)."""
    chunks = chunk_table.shape[1]
    _copy[(chunks,)](chunk_table, chunks, copy_table, copy_table.shape[1], entry_addresses,
                     tensor_addresses, ITEMSIZE=itemsize, CONTIGUOUS=contiguous, BLOCK=BLOCK)
