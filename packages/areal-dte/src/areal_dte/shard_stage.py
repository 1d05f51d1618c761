"""Stage payloads named in the sender's layout into one rank's own layout.

A trainer encodes its weights under their Hugging Face names (or in its own layout, e.g.
Megatron's fused and interleaved tensors); a rollout rank holds them
fused and sharded (SGLang's ``qkv_proj``, ``gate_up_proj``, ``experts.w13_weight``, a
padded vocab, one TP slice of each). ``ShardStage`` is a ``dte_transport.receiver.Stage``
for such a rank. It checks a payload against the sender's tensors with
``dte_codec.apply.check_fit`` on meta tensors (the checks and errors of a receiver that
held them by name), then maps every entry onto the local tensors through the shard's
pieces:

- a sparse entry's flat indices go through ``dte_codec.remap.remap``, batched over every
  local tensor the entry reaches; residues resolve against the local values there;
- a dense or box entry is cut into the boxes of the local tensors it overlaps.

Elements that no piece of this shard holds (another rank's slice) are dropped; local
elements that no piece covers (vocab padding) are never written. The result is a
``dte_codec.apply.Prepared``: its writes are all or nothing, with the codec's undo log.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch
from dte_codec import Kind, Payload
from dte_codec.apply import Prepared, Staged, check_fit
from dte_codec.errors import GeometryError
from dte_codec.geometry import Piece, Shard, Transfer, plan
from dte_codec.header import Entry
from dte_codec.region import Box
from dte_codec.remap import remap
from dte_codec.values import decode_values


@attrs.frozen
class ShardStage:
    """Stages canonical payloads into the local tensors of one shard.

    Build it with ``ShardStage.of``; call it as ``stage(weights, payload)``.
    """

    canonical: Mapping[str, torch.Tensor]
    """Every sender tensor as a meta tensor (names, shapes and dtypes to check)."""
    transfers: Mapping[str, tuple[Transfer, ...]]
    """Per sender tensor, its boxes in the shard's local tensors (``geometry.plan``)."""
    pieces: Mapping[str, tuple[Piece, ...]]
    """Per sender tensor, the same boxes as pieces (region: the box in the sender's
    tensor; local: where the shard holds it)."""

    @classmethod
    def of(cls, source: Shard, shard: Shard,
           weights: Mapping[str, torch.Tensor]) -> ShardStage:
        """The stage from the sender's layout ``source`` (``layouts.hf_shard``, or a
        trainer shard such as ``megatron_shard``) into ``shard``, whose local tensors are
        ``weights``.

        Raises:
            GeometryError: ``weights`` are not the shard's tensors (names, shapes,
                dtypes) or not contiguous.
        """
        shard.check_tensors(weights)
        strided = sorted(n for n, t in weights.items() if not t.is_contiguous())
        if strided:
            raise GeometryError("layout", expected="contiguous local tensors",
                                got=f"strided {strided[:5]}")
        transfers = plan(source, [shard])
        # A transfer is a piece of the source tensor seen from the shard: its source box
        # plays the region, so dense and box entries are cut by the same geometry as
        # sparse ones, whatever the source's own layout.
        pieces = {name: tuple(Piece(tensor=t.target_tensor, local=t.target_box, canonical=name,
                                    region=t.source_box) for t in ts)
                  for name, ts in transfers.items()}
        canonical = {name: torch.empty(spec.shape, dtype=spec.dtype, device="meta")
                     for name, spec in source.tensors.items()}
        return cls(canonical=canonical, transfers=transfers, pieces=pieces)

    def __call__(self, weights: Mapping[str, torch.Tensor], payload: Payload) -> Prepared:
        """Check ``payload`` and resolve it into ``weights``, writing nothing.

        Raises:
            MismatchError: the payload does not fit the canonical tensors.
            EntryError: a residue does not resolve against this rank's values.
            GeometryError: an index outside its canonical tensor.
        """
        kind = check_fit(self.canonical, [payload])
        staged: list[Staged] = []
        for entry, where, sections in zip(payload.header.entries, payload.indices,
                                          payload.values):
            if isinstance(where, Box):
                staged.extend(self._boxes(weights, entry, where, sections[0],
                                          keep_undo=kind == Kind.DELTA))
            else:
                staged.extend(self._sparse(weights, entry, where, sections))
        return Prepared(tuple(staged), kind == Kind.FULL)

    def _sparse(self, weights: Mapping[str, torch.Tensor], entry: Entry,
                indices: torch.Tensor, sections: tuple[torch.Tensor, ...]) -> list[Staged]:
        routed = {name: r for (_, name), r in remap(
            self.transfers[entry.name], entry.shape, indices, tensor=entry.name).items()
            if r.indices.numel()}
        if not routed:
            return []
        device = weights[next(iter(routed))].device
        # Residues resolve against a base value per carried element, but this rank holds
        # only some of them. The others get +0.0, the middle of the key order: a residue
        # moves a key by less than a quarter of the range, so they decode without a range
        # error, and their values are dropped.
        base = torch.zeros(entry.count, dtype=entry.dtype, device=device)
        for name, r in routed.items():
            base[r.positions] = weights[name].view(-1)[r.indices]
        new = decode_values(entry, tuple(s.to(device) for s in sections), base)
        return [Staged(name, weights[name], r.indices, new[r.positions], keep_undo=True)
                for name, r in routed.items()]

    def _boxes(self, weights: Mapping[str, torch.Tensor], entry: Entry, box: Box,
               raw: torch.Tensor, *, keep_undo: bool) -> list[Staged]:
        values = None
        staged = []
        for piece in self.pieces[entry.name]:
            common = piece.region.intersect(box)
            if common.numel == 0:
                continue
            if values is None:
                values = raw.to(weights[piece.tensor].device).view(entry.dtype).view(box.size)
            inside = Box([c - b for c, b in zip(common.start, box.start)], common.size)
            local = piece.to_local(common)
            staged.append(Staged(piece.tensor, weights[piece.tensor], local,
                                 values[inside.slices()].reshape(local.size),
                                 keep_undo=keep_undo))
        return staged
