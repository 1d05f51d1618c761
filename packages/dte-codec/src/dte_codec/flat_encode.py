"""Delta encoding of all changed tensors at once, in one flat index space.

Produces the same bytes as encoding tensor by tensor (``parts.sparse_part`` and
``encode.encode_delta_per_tensor``, the reference), with a fixed number of torch ops over
all changed elements instead of a few dozen per tensor, and one host synchronization per
payload whatever the number of tensors:

1. One pass computes, per element, its gap to the previous index, whether the index is
   valid, and the residue width its value needs; segment reductions turn these into,
   per tensor, the number of gaps over one byte, a validity count and a histogram of
   residue widths. One copy to the host (the synchronization).
2. On the host, every encoding follows in closed form from those numbers and the tensor's
   count and numel, with a few numpy ops over all tensors (``encoding_choice``: the
   encodings; ``encode_plan``: dense fallback, entries and body layout); what follows
   from the counts alone (every candidate size but those the statistics decide) is
   computed while the device counts (``encode_plan.prepare``), and the device ranks
   escapes from the encodings alone while the host lays the body out (``count_escapes``,
   whose ``Escapes`` the write takes). What
   depends only on the tensor set (names, dtypes, shapes, addresses, each entry's packed
   bytes, the kernels' per-tensor columns) is kept across syncs (``tensor_set``), so the
   Python per tensor left in a sync is reading its change set.
3. One pass writes every field of every winning encoding into one zeroed body buffer on
   the device; dense entries are copied in; while the device writes, the header is
   packed from the plan's columns (``entry_pack``); the body stays there, its digest is
   queued behind it (``Frame.pending_digest``), and the frame goes on before either is
   done.

On a GPU with Triton (``dispatch.fused``) the device work is three fused kernels
(``encode_kernel``) that read the change sets and tensors in place: one byte per element
as the only temporary, a fixed number of launches, the body as the only large buffer. Elsewhere
(and under ``dispatch.reference()``) ``TorchFlat`` does it with torch ops: one gather of
new values per tensor and about a dozen int64 temporaries per element. Both write the
same bytes as the reference. A change set that fails validation sends the call down the
reference path, which raises the error it always raised.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from .bits import BYTE_BITS, bit_length, order_keys_by_width, width_mask
from .body_digest import queued_digest
from .change_table import ChangeTable, Members, bounds_fit, change_counts, parts
from .dispatch import fused
from .encode_plan import Choice, Escapes, Layout, prepare
from .encodings import BITMAP, ELIAS_FANO, GAP8, RESIDUE, RESIDUE_DTYPES, Kind
from .errors import EncodeError
from .fields import Body, Segments, host_table
from .header import pack_head
from .indices import MAX_GAP_BYTE
from .parts import bytes_of, checked_header, seal, seal_packed
from .tensor_set import TensorSet, tensor_set

if TYPE_CHECKING:
    from .encode import ChangeSet
    from .encode_kernel import FusedFlat
    from .frame import Frame

_INT64 = torch.int64


def encode_delta_flat(tensors: Mapping[str, torch.Tensor], changes: Mapping[str, ChangeSet], *,
                      stream_id: str, base_version: int, version: int) -> Frame | None:
    """The delta payload of ``tensors`` with one change set each (the non-empty ones are
    sent), or None when a change set does not fit its tensor or the changed tensors are
    not on one device (the caller then takes the reference path, which raises its
    error). Change sets that a batched detection left in flat runs
    (``change_table.parts``) are read as runs, with the same bytes."""
    known = tensor_set(tensors)
    runs, loose = parts(changes)
    members = Members.of(known, runs)
    if members is None:
        return None
    counts = change_counts(known, members, loose)
    rows = np.flatnonzero(counts)
    if not len(rows):
        return seal(checked_header([], stream_id=stream_id, kind=Kind.DELTA,
                                   base_version=base_version, version=version),
                    torch.empty(0, dtype=torch.uint8))
    picked, count = rows.tolist(), counts[rows]
    devices = {known.key.devices[r] for r in picked} if known.device is None else {known.device}
    if len(devices) > 1 or not known.encodable[rows].all():
        return None
    device = devices.pop()
    every = list(tensors.values())
    weights = [every[r] for r in picked]
    flat = _flat(known, rows, counts=counts, changes=changes, members=members, loose=loose,
                 weights=weights, device=device)
    if flat is None:
        return None
    bits = known.bits[rows][known.table.residue[rows]]
    bins = int(bits.max()) if len(bits) else 0
    pending = flat.stats(bins)
    # while the device counts: what needs no statistics
    counted, templates = prepare(known.table.take(rows), count, bins), known.templates
    try:  # raised after the statistics, as the reference reports bad indices first
        header, bad_header = checked_header([], stream_id=stream_id, kind=Kind.DELTA,
                                            base_version=base_version, version=version), None
    except EncodeError as error:
        header, bad_header = None, error
    stats = pending.cpu().numpy()  # the host synchronization
    segments = len(picked)
    if stats[:, 1].any():  # invalid indices
        return None
    if bad_header is not None:
        raise bad_header
    choice = counted.choose(gap_escapes=stats[:, 0], hist=stats[:, 2:])
    escapes = flat.count_escapes(choice)  # the device counts while the host lays out
    chosen = counted.plan(choice, device=device)
    body = flat.write(chosen.layout, escapes)
    _put_dense(body, chosen.layout, weights)
    # packed while the device writes the body
    head = pack_head(header, entries=segments, table=templates.pack(rows, chosen.fields()),
                     body_size=chosen.layout.size)
    # the digest stays queued: the host hands the frame on while the device writes it
    return seal_packed(head, (body,), queued_digest((body,)), body_size=chosen.layout.size)


def _put_dense(body: torch.Tensor, layout: Layout, weights: list[torch.Tensor]) -> None:
    """Copy the entries that fell back to dense (``weights``: one per entry) into their
    place in ``body``, which ``write`` left zero there."""
    for s in np.flatnonzero(layout.dense_offsets >= 0).tolist():
        offset = int(layout.dense_offsets[s])
        data = bytes_of(weights[s])
        body[offset:offset + data.numel()].copy_(data)


def _flat(known: TensorSet, rows: np.ndarray, *, counts: np.ndarray,
          changes: Mapping[str, ChangeSet], members: Members, loose: Mapping[str, ChangeSet],
          weights: list[torch.Tensor], device: torch.device) -> TorchFlat | FusedFlat | None:
    """The fused kernels where they run (``dispatch.fused``), else the torch ops; None
    when a change set does not fit its tensor. ``members`` and ``loose``: ``changes`` as
    runs and as change sets outside them (``change_table.parts``)."""
    if fused(device):
        from .encode_kernel import FusedFlat
        found = ChangeTable.of(known, members, loose, counts, device)
        return None if found is None else FusedFlat(known, rows, counts[rows], found, weights,
                                                    device)
    picked = rows.tolist()
    todo = [changes[known.names[r]] for r in picked]
    if not bounds_fit([known.table.dtypes[r] for r in picked], counts[rows].tolist(), todo):
        return None
    return TorchFlat.gather(weights, todo, device)


class TorchFlat:
    """Indices, value bit patterns and bounds of every changed element, back to back, as
    int64 tensors (about a dozen per element at the peak)."""

    def __init__(self, segs: Segments, table: torch.Tensor, idx: torch.Tensor,
                 pattern: torch.Tensor, low: torch.Tensor, high: torch.Tensor):
        self.segs, self.idx, self.pattern = segs, idx, pattern
        numel, bits, residue = (segs.spread(table[k]) for k in range(3))
        self.bits = bits
        self.gap = idx - segs.previous(idx, -1)
        self.wide = self.gap > MAX_GAP_BYTE
        self.bad = (idx < 0) | (idx >= numel) | (self.gap <= 0)
        key_bits = torch.where(residue > 0, bits, 16)
        self.key = order_keys_by_width(pattern, key_bits)
        above = self.key - order_keys_by_width(low, key_bits) + 1
        below = order_keys_by_width(high, key_bits) - self.key
        span = torch.maximum(torch.maximum(above, below), torch.ones_like(above))
        self.need = torch.where(residue > 0, 1 + bit_length(span - 1), 0)

    @classmethod
    def gather(cls, weights: list[torch.Tensor], changes: list, device: torch.device
               ) -> TorchFlat:
        segs = Segments.of([c.indices.numel() for c in changes], device)
        table = host_table([[w.numel() for w in weights],
                            [w.element_size() * BYTE_BITS for w in weights],
                            [int(w.dtype in RESIDUE_DTYPES) for w in weights]], device)
        idx = torch.cat([c.indices.reshape(-1).to(device) for c in changes]).to(_INT64)
        # Gather at clamped indices: an invalid one is reported after the statistics, and
        # must not trip a device assert first.
        safe = torch.minimum(idx.clamp(min=0), segs.spread(table[0]) - 1)
        values = [_int_view(w.reshape(-1)).index_select(0, p)
                  for w, p in zip(weights, safe.split(list(segs.counts)))]
        lows = [_int_view(c.base_low.to(device)) for c in changes]
        highs = [_int_view(c.base_high.to(device)) for c in changes]
        bits = segs.spread(table[1])
        return cls(segs, table, idx, *(_patterns(torch.cat(v), bits)
                                       for v in (values, lows, highs)))

    def stats(self, bins: int) -> torch.Tensor:
        """On the device, per tensor (rows): gaps over a byte, invalid indices, and the
        histogram of the residue widths ``0..bins-1`` that values need (columns)."""
        segs = self.segs
        return torch.cat([segs.sums(self.wide)[:, None], segs.sums(self.bad)[:, None],
                          segs.histogram(self.need, bins)], 1)

    def count_escapes(self, choice: Choice) -> Escapes:
        """Per element, the GAP8 gaps and the residues escaped before it in its tensor,
        under the encodings ``choice`` (before the dense fallback: a dense entry's ranks
        are never read)."""
        enc, venc, vwidth = (self.segs.spread(column) for column in
                             host_table(choice.columns(), self.idx.device))
        gaps = self.segs.exclusive_ranks((enc == GAP8) & self.wide)
        values = self.segs.exclusive_ranks((venc == RESIDUE) & (self.need > vwidth))
        return Escapes(self, (gaps, values))

    def write(self, layout: Layout, escapes: Escapes) -> torch.Tensor:
        """The body laid out by ``layout`` as uint8 on the device, dense entries left zero;
        ``escapes``: this encoder's ``count_escapes`` of the encodings ``layout`` lays out."""
        gaps, values = escapes.ranks_for(self)
        body = Body(layout.size, self.segs.total, self.idx.device)
        home = self._write_indices(body, layout, gaps)
        self._write_values(body, layout, home, values)
        return body.bytes()

    def _write_indices(self, body: Body, layout: Layout, before: torch.Tensor) -> torch.Tensor:
        col, rank, idx = layout.column(self.segs), self.segs.rank, self.idx
        enc = col("index_encoding")
        is_gap, is_bitmap = enc == GAP8, enc == BITMAP
        # First section: raw index, gap byte, low bits or bitmap bit; dense entries get a
        # zero-width field inside their own section, so no word gathers empty adds.
        home = col("first") + rank * col("stride") + torch.where(is_bitmap, idx, 0)
        small = torch.where(self.wide, 0, self.gap)
        body.write(home, torch.where(is_gap, small, torch.where(is_bitmap, 1, idx)),
                     col("width"))
        # Second section: escaped gaps, or the Elias-Fano upper bits.
        escaped = is_gap & self.wide
        second, itemsize = col("second"), col("escape_bits")
        pos = torch.where(is_gap, second + before * itemsize,
                          second + (idx >> col("low_width")) + rank)
        width = torch.where(escaped, itemsize, (enc == ELIAS_FANO).to(_INT64))
        body.write(torch.where(width > 0, pos, home),
                     torch.where(is_gap, self.gap, 1), width)
        return home

    def _write_values(self, body: Body, layout: Layout, home: torch.Tensor,
                      before: torch.Tensor) -> None:
        col, rank = layout.column(self.segs), self.segs.rank
        enc, width = col("value_encoding"), col("value_width")
        residue = enc == RESIDUE
        escaped = residue & (self.need > width)
        fields, positions, raw = col("fields"), col("positions"), col("raw")
        item_bits = torch.where(enc >= 0, self.bits, 0)
        pos = torch.where(residue, torch.where(escaped, positions + before * col("position_bits"),
                                               fields + (rank - before) * width),
                          raw + rank * item_bits)
        value = torch.where(residue, torch.where(escaped, rank, self.key), self.pattern)
        bits = torch.where(residue, torch.where(escaped, col("position_bits"), width), item_bits)
        body.write(torch.where(bits > 0, pos, home), value, bits)
        escaped_bits = torch.where(escaped, self.bits, 0)
        body.write(torch.where(escaped, raw + before * self.bits, home), self.pattern,
                     escaped_bits)


def _int_view(values: torch.Tensor) -> torch.Tensor:
    return values.view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                        8: torch.int64}[values.element_size()])


def _patterns(values: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Unsigned ``bits``-wide bit patterns as int64 (64-bit patterns keep their sign)."""
    return values.to(_INT64) & width_mask(bits)
