"""Compile the codec's kernels before the first sync.

Triton compiles a kernel the first time it meets a specialisation (its ``constexpr``
arguments, and which pointer arguments are 16-byte aligned), ~0.3-0.4 s each, so without
a warm-up the first full and delta syncs of a run pay for every codec kernel. ``warm_up``
runs one tiny sync of each kind through the paths a GPU sync takes, for each payload
dtype: a full payload (body digest) decoded and applied, written box by box into a
fused local tensor (box copies of every item size and of strided rows), then a delta
with every index encoding and residues with escapes (the encoder, the decoder with its
stream pass, residues, the undo gather and scatter), also staged through a shard's
routes (the route, which gathers, and the scatter). Counts, sizes and table shapes are runtime
arguments of every kernel, so a real model's sync reuses these compilations; tensors of
2**31 or more elements (64-bit route coordinates) are the one variant left to compile on
first use.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace

import torch

from .apply import apply_
from .box_copy import CopyPlan, Cut
from .decode import decode, decode_batched
from .dispatch import fused
from .encode import encode_delta_batched, encode_full
from .encodings import RESIDUE_DTYPES
from .geometry import Piece, Shard, TensorSpec, plan
from .region import Box
from .routes import Routes, stage_routed
from .sparse_entries import SparseEntries

_ROWS = 64
_COLUMNS = {"a": 48, "b": 13, "c": 1}
"""Canonical matrices fused side by side into one local tensor: rows of whole words, of
odd length, and a single column (strided rows)."""
_FUSED = 64
_FLAT = {"d": 65536, "e": 65536}
"""Canonical vectors held whole: room for Elias-Fano and for GAP8 with escapes."""
_STREAM = "dte_codec.warm_up"


def warm_up(device: torch.device | str, *,
            payloads: Iterable[torch.dtype] = (torch.bfloat16,)) -> None:
    """Compile the codec's kernels for syncs of ``payloads`` tensors on ``device``
    (bf16, fp16 and fp32; other dtypes are left to compile on first use).

    Does nothing where the kernels do not run or are not compiled (a CPU device, also
    under Triton's interpreter; no triton; inside ``dispatch.reference()``). Costs one
    compilation per specialisation, or a load from Triton's on-disk cache in a later
    process.
    """
    device = torch.device(device)
    if device.type != "cuda" or not fused(device):  # nothing is compiled elsewhere
        return
    for dtype in dict.fromkeys(payloads):
        if dtype in RESIDUE_DTYPES:
            _sync(device, dtype)
    torch.cuda.synchronize(device)


def _sync(device: torch.device, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    old = {name: torch.randn(_ROWS, n, generator=gen).to(dtype).to(device)
           for name, n in _COLUMNS.items()}
    old |= {name: torch.randn(n, generator=gen).to(dtype).to(device)
            for name, n in _FLAT.items()}
    receiver = {name: torch.zeros_like(t) for name, t in old.items()}
    full = decode(encode_full(old, stream_id=_STREAM, version=1))
    apply_(receiver, full)
    _copy_boxes(full, device)
    new = {name: t.clone() for name, t in old.items()}
    changes = {name: _step(new[name], indices.to(device))
               for name, indices in _changed().items()}
    # the batched paths, which a GPU takes (and the CPU under the interpreter with them)
    delta = decode_batched(encode_delta_batched(new, changes, stream_id=_STREAM,
                                                base_version=1, version=2))
    apply_(receiver, delta)
    _route(delta, old, device)


def _changed() -> dict[str, torch.Tensor]:
    """Per tensor, indices that make its encoder pick BITMAP, GAP8 (with an escape) and
    Elias-Fano indices."""
    return {"a": torch.arange(0, _ROWS * _COLUMNS["a"], 2),
            "b": torch.tensor([0, 300, 600]),
            "c": torch.arange(_ROWS),
            "d": torch.arange(0, _FLAT["d"], 301),
            "e": torch.cat([torch.arange(200), torch.arange(40000, 40200)])}


def _step(tensor: torch.Tensor, indices: torch.Tensor) -> SimpleNamespace:
    """Move ``tensor`` at ``indices`` by one ulp, every seventh by many (residue escapes);
    its exact change set."""
    flat = tensor.view(-1)
    old = flat[indices].clone()
    step = torch.where(torch.arange(indices.numel(), device=indices.device) % 7 == 0, 20000, 1)
    bits = {2: torch.int16, 4: torch.int32}[tensor.element_size()]
    flat.view(bits)[indices] += step.to(bits)
    return SimpleNamespace(indices=indices, base_low=old, base_high=old)


def _copy_boxes(full, device: torch.device) -> None:
    """The full payload's matrices written into one fused local tensor by box copies:
    whole-word rows, rows of odd length and a strided column, word-aligned and not."""
    local = {"fused": torch.zeros(_ROWS, _FUSED, dtype=full.header.entries[0].dtype,
                                  device=device)}
    cuts, at = [], 0
    for k, entry in enumerate(full.header.entries[:len(_COLUMNS)]):
        cuts.append(Cut(k, "fused", Box.whole(entry.shape), entry.shape,
                        Box((0, at), entry.shape), (_ROWS, _FUSED)))
        at += entry.shape[1]
    values = [sections[0] for sections in full.values[:len(_COLUMNS)]]
    for aligned in (True, False):
        copies = CopyPlan.of(cuts, {"fused": local["fused"].element_size()}, device,
                             aligned=aligned)
        copies.write(values, local)


def _route(delta, old: dict[str, torch.Tensor], device: torch.device) -> None:
    """The delta's sparse entries staged through a shard that fuses the matrices into
    one local tensor and holds the vectors whole, then written."""
    specs = {name: TensorSpec(tuple(t.shape), t.dtype) for name, t in old.items()}
    source = Shard(rank=0, tensors=specs,
                   pieces=[Piece(tensor=n, local=Box.whole(s.shape), canonical=n,
                                 region=Box.whole(s.shape)) for n, s in specs.items()])
    dtype = next(iter(specs.values())).dtype
    pieces, at = [], 0
    for name, columns in _COLUMNS.items():
        pieces.append(Piece(tensor="fused", local=Box((0, at), (_ROWS, columns)),
                            canonical=name, region=Box.whole(specs[name].shape)))
        at += columns
    pieces += [Piece(tensor=n, local=Box.whole(specs[n].shape), canonical=n,
                     region=Box.whole(specs[n].shape)) for n in _FLAT]
    local_specs = {"fused": TensorSpec((_ROWS, _FUSED), dtype)} | {n: specs[n] for n in _FLAT}
    target = Shard(rank=0, tensors=local_specs, pieces=pieces)
    local = {name: torch.zeros(s.shape, dtype=s.dtype, device=device)
             for name, s in local_specs.items()}
    for piece in pieces:  # the base the residues resolve against
        local[piece.tensor][piece.local.slices()] = old[piece.canonical].view(piece.local.size)
    routes = Routes.of(plan(source, [target]), {n: s.shape for n, s in specs.items()},
                       {n: s.dtype for n, s in specs.items()}, local, device)
    # as ShardStage routes it: from the decoded body (Payload.flat), else from its tensors
    sparse = SparseEntries.of_flat(delta.flat) if delta.flat is not None else (
        SparseEntries.of_tensors([(e, i, s) for e, i, s in zip(
            delta.header.entries, delta.indices, delta.values) if isinstance(i, torch.Tensor)],
            device))
    staged = (stage_routed(routes, local, sparse, targets=routes.target_addresses(local))
              if sparse is not None else None)
    if staged is not None:
        staged.write()
