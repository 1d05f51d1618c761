"""The reference staging of a payload's sparse entries into one shard's local tensors
(``ShardStage`` where the kernels do not run, or give way): every entry remapped by one
``dte_codec.batched_remap.remap_all``, its values resolved against the local values
there (residues of all entries on a GPU together), as writes into the local tensors.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import torch
from dte_codec.apply import Staged
from dte_codec.batched_remap import RemapItem, remap_all
from dte_codec.encodings import ValueEncoding
from dte_codec.entry import Entry
from dte_codec.fields import batched
from dte_codec.fit import check_contiguous
from dte_codec.flat_values import resolve_residues
from dte_codec.geometry import Transfer
from dte_codec.remap import Remapped
from dte_codec.values import decode_values


def stage_sparse(transfers: Mapping[str, tuple[Transfer, ...]],
                 weights: Mapping[str, torch.Tensor],
                 entries: list[tuple[Entry, torch.Tensor, tuple[torch.Tensor, ...]]]
                 ) -> list[list[Staged]]:
    """Every sparse entry of ``entries`` (entry, flat indices, value sections) staged
    through ``transfers`` (per sender tensor, ``geometry.plan``'s) into ``weights``.

    Raises:
        GeometryError: an index outside its sender tensor.
        MismatchError: an entry reaches a local tensor that is not contiguous (the
            writes go through flat views); nothing was written.
        EntryError: a residue does not resolve against the local values.
    """
    items = [RemapItem(transfers[entry.name], entry.shape,
                       _on_rank(transfers[entry.name], weights, indices), tensor=entry.name)
             for entry, indices, _ in entries]
    routed = [{name: r for (_, name), r in out.items() if r.indices.numel()}
              for out in remap_all(items)]
    # a local tensor may have been replaced since the stage was built
    for name in dict.fromkeys(name for where in routed for name in where):
        check_contiguous(name, weights[name])
    bases = [_base(weights, entry, where) for (entry, _, _), where in zip(entries, routed)]
    values = _resolve(entries, bases)
    return [[Staged(name, weights[name], r.indices, new[r.positions], keep_undo=True)
             for name, r in where.items()]
            for where, new in zip(routed, values)]


def _on_rank(transfers: tuple[Transfer, ...], weights: Mapping[str, torch.Tensor],
             indices: torch.Tensor) -> torch.Tensor:
    """``indices`` on the device of the local tensors they reach (if any)."""
    return indices.to(weights[transfers[0].target_tensor].device) if transfers else indices


def _base(weights: Mapping[str, torch.Tensor], entry: Entry,
          routed: Mapping[str, Remapped]) -> torch.Tensor | None:
    """The local value under each element of ``entry`` this rank holds, +0.0 elsewhere;
    None when it holds none."""
    # Residues resolve against a base value per carried element, but this rank holds
    # only some of them. The others get +0.0, the middle of the key order: a residue
    # moves a key by less than a quarter of the range, so they decode without a range
    # error, and their values are dropped.
    if not routed:
        return None
    base = torch.zeros(entry.count, dtype=entry.dtype,
                       device=weights[next(iter(routed))].device)
    for name, r in routed.items():
        base[r.positions] = weights[name].view(-1)[r.indices]
    return base


def _resolve(entries: list[tuple[Entry, torch.Tensor, tuple[torch.Tensor, ...]]],
             bases: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """New values of every entry with a base: residue entries on a GPU resolved together
    per device (``flat_values.resolve_residues``, one host synchronization), the others
    and any group with a residue out of range by ``decode_values``, which raises its
    error."""
    values: list[torch.Tensor | None] = [None] * len(entries)
    together: dict[torch.device, list[int]] = defaultdict(list)
    for k, ((entry, _, _), base) in enumerate(zip(entries, bases)):
        if base is not None and entry.value_encoding == ValueEncoding.RESIDUE \
                and batched(base.device):
            together[base.device].append(k)
    for ks in together.values():
        new, failures = resolve_residues([entries[k][0] for k in ks],
                                         [entries[k][2] for k in ks], [bases[k] for k in ks])
        if not int(failures):
            for k, v in zip(ks, new):
                values[k] = v
    for k, ((entry, _, sections), base) in enumerate(zip(entries, bases)):
        if base is not None and values[k] is None:
            values[k] = decode_values(entry, tuple(s.to(base.device) for s in sections), base)
    return values
