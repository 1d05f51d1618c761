"""Residue values of every entry resolved at once against the receiver's base values.

The same values as ``values.decode_values`` entry by entry. Where the kernels run
(``dispatch.fused``) that is three launches (``values_kernel``); otherwise a fixed
number of torch ops over all carried elements: each entry's residue fields, escape
positions and escaped values are gathered into one buffer per section kind (one
concatenation each), then read as fields at computed positions (``fields.read_fields``).
The reference's one check (a residue that resolves outside the dtype's key range)
becomes a count on the device that the caller reads with one host synchronization,
falling back to the reference to raise its error.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import torch

from .bits import BYTE_BITS, from_order_keys_by_width, order_keys_by_width, width_mask
from .dispatch import fused
from .encodings import align, index_itemsize
from .entry import Entry
from .fields import WORD_BYTES, Segments, host_table, read_fields

_INT64 = torch.int64
_INT_VIEWS = {2: torch.int16, 4: torch.int32}


@attrs.frozen
class Residues:
    """Residue entries as numpy columns (one value per entry): what ``_resolve`` and
    ``_escaped`` read, their sections and base values reached through addresses."""

    count: np.ndarray
    itemsize: np.ndarray
    width: np.ndarray
    escapes: np.ndarray
    fields_at: np.ndarray
    """Address of the residue fields (8-byte aligned; whole words are read)."""
    fields_bytes: np.ndarray
    positions_at: np.ndarray
    raw_at: np.ndarray
    base_at: np.ndarray
    """Address of the entry's ``count`` base values (contiguous)."""

    @classmethod
    def of(cls, entries: Sequence[Entry], sections: Sequence[tuple[torch.Tensor, ...]],
           bases: Sequence[torch.Tensor]) -> Residues:
        """The columns of RESIDUE ``entries``, given their value sections and bases
        (contiguous, alive while the kernels run)."""
        fields, positions, raw = ([s[k] for s in sections] for k in range(3))

        def column(values) -> np.ndarray:
            return np.fromiter(values, dtype=np.int64, count=len(entries))

        return cls(column(e.count for e in entries), column(e.itemsize for e in entries),
                   column(e.value_width for e in entries),
                   column(e.value_escapes for e in entries),
                   column(f.data_ptr() for f in fields), column(f.numel() for f in fields),
                   column(p.data_ptr() for p in positions), column(r.data_ptr() for r in raw),
                   column(b.data_ptr() for b in bases))


@attrs.frozen
class Resolved:
    """New values of residue entries, entry by entry in one byte buffer (each from an
    8-byte boundary), and the count of residues that did not resolve."""

    out: torch.Tensor
    offsets: np.ndarray
    failures: torch.Tensor

    def views(self, entries: Sequence[Entry]) -> list[torch.Tensor]:
        return [self.out[o:o + e.count * e.itemsize].view(e.dtype)
                for e, o in zip(entries, self.offsets.tolist())]


def resolve_residues(entries: Sequence[Entry], sections: Sequence[tuple[torch.Tensor, ...]],
                     bases: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """New values of RESIDUE ``entries`` (value ``sections`` on the bases' device), and the
    number of residues that resolve outside the key range (0 when all are valid)."""
    device = bases[0].device
    if fused(device):
        moved = [tuple(s.to(device) for s in entry_sections) for entry_sections in sections]
        if all(s.data_ptr() % WORD_BYTES == 0 for ss in moved for s in ss):  # word reads
            from .values_kernel import resolve
            return resolve(entries, moved, bases)
    segs = Segments.of([e.count for e in entries], device)
    (fields, field_at), (positions, position_at), (raw, raw_at) = (
        _packed([s[k] for s in sections], device) for k in range(3))
    table = host_table([field_at, [e.value_width for e in entries], position_at,
                        [index_itemsize(e.count) * BYTE_BITS for e in entries], raw_at,
                        [e.itemsize * BYTE_BITS for e in entries]], device)
    field_start, width, _, _, raw_start, bits = (segs.spread(table[k]) for k in range(6))
    escaped = _escaped(entries, table, positions, segs)
    before = segs.exclusive_ranks(escaped)
    residue = read_fields(fields, field_start + (segs.rank - before) * width,
                          torch.where(escaped, 0, width))
    pattern = torch.cat([b.view(_INT_VIEWS[b.element_size()]) for b in bases]).to(_INT64)
    base_key = order_keys_by_width(pattern & width_mask(bits), bits)
    diff = (residue - base_key) & width_mask(width)
    half = torch.ones_like(width) << (width - 1)
    key = base_key + torch.where(diff >= half, diff - 2 * half, diff)
    failures = (~escaped & ((key < 0) | (key > width_mask(bits)))).sum()
    sent = read_fields(raw, raw_start + before * bits, torch.where(escaped, bits, 0))
    new = torch.where(escaped, sent, from_order_keys_by_width(key & width_mask(bits), bits))
    counts = [e.count for e in entries]
    views = {size: new.to(dtype).split(counts) for size, dtype in _INT_VIEWS.items()
             if any(e.itemsize == size for e in entries)}
    return [views[e.itemsize][k].view(e.dtype) for k, e in enumerate(entries)], failures


def _escaped(entries: Sequence[Entry], table: torch.Tensor, positions: torch.Tensor,
             segs: Segments) -> torch.Tensor:
    """Per element, whether it is sent raw (its position is in its entry's escape list)."""
    escaped = torch.zeros(segs.total, dtype=torch.bool, device=positions.device)
    if not any(e.value_escapes for e in entries):
        return escaped
    lists = Segments.of([e.value_escapes for e in entries], positions.device)
    start, bits = lists.spread(table[2]), lists.spread(table[3])
    at = read_fields(positions, start + lists.rank * bits, bits)
    first = lists.spread(host_table([list(segs.starts)], positions.device)[0])
    # decode validated the positions; clamping keeps a forged Payload off device asserts
    escaped.index_fill_(0, (first + at).clamp(0, segs.total - 1), True)
    return escaped


def _packed(pieces: list[torch.Tensor], device: torch.device
            ) -> tuple[torch.Tensor, list[int]]:
    """``pieces`` back to back, each from a word boundary, as int64 words; bit offsets."""
    zeros = torch.zeros(WORD_BYTES, dtype=torch.uint8, device=device)
    parts, starts, offset = [], [], 0
    for piece in pieces:
        starts.append(offset * BYTE_BITS)
        parts += [piece.reshape(-1).to(device), zeros[:align(piece.numel()) - piece.numel()]]
        offset += align(piece.numel())
    parts.append(zeros)  # never empty
    return torch.cat(parts).view(_INT64), starts
