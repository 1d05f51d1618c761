"""Exact dirty bits recorded where fp32 master weights are cast into the model copy.

Call ``record`` right before the master is copied into the low-precision model tensor
(Megatron's ``_copy_main_params_to_model_params``, or ``model.copy_(master)`` in a plain
loop): an element is dirty iff ``cast(master)`` and the model differ in bits, or both are
NaN (which NaN pattern the copy writes depends on the tensor's layout). Dirty bits
accumulate in a packed map (1 bit per element) over any number of optimizer steps of any
optimizer until ``clear``. The value an element had when it first turned dirty is the
receiver's base, so it is kept too (O(changed) memory), which makes the change sets exact:
bases are exact, and the only elements reported without a bit change are those that
changed and came back since the clear, and NaN over NaN.

``record_and_copy`` is ``record`` followed by ``model.copy_(master)``, the compare-and-copy
that a trainer's master -> model cast hook needs; on CUDA with a 16-bit contiguous model
both run fused in one pass (``cast_kernel.py``, see ``dispatch``), bit for bit the same.
``record_all``/``record_and_copy_all`` take all tensors of a step at once: on CUDA one
pass over all of them instead of one launch and one host synchronisation per tensor.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import attrs
import torch

from . import dispatch, layout
from .changes import ChangeRun, ChangeSet, FlatChanges, index_dtype, int_bits
from .errors import ResizedError


_MAP_ALIGN = 16
"""Bytes: where the fused kernels' dirty maps start."""


def _route(master: torch.Tensor, model: torch.Tensor) -> torch.device | str:
    """The device whose kernels record the pair, or the torch reference."""
    if (master.dtype == torch.float32 and model.is_contiguous() and model.numel() > 0
            and master.numel() == model.numel() and master.device == model.device
            and dispatch.kernels_for(master, model, payload=model.dtype)):
        return model.device
    return layout.REFERENCE


def _pack(mask: torch.Tensor) -> torch.Tensor:
    """A flat bool tensor as bits, LSB first (uint8 arithmetic: 1 byte of scratch per bit)."""
    padded = torch.zeros(-(-mask.numel() // 8) * 8, dtype=torch.uint8, device=mask.device)
    padded[: mask.numel()] = mask
    weights = 1 << torch.arange(8, device=mask.device, dtype=torch.uint8)
    return (padded.view(-1, 8) * weights).sum(1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor, count: int) -> torch.Tensor:
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    return ((packed.unsqueeze(1) >> shifts) & 1).view(-1)[:count].bool()


@attrs.frozen(eq=False)
class _Maps:
    """The dirty maps of the tensors a kept layout sends through the kernels."""

    kept: layout.Layout
    per_tensor: list[torch.Tensor | None]
    """Per tensor of the layout's calls, its map (None: the torch reference's tensors)."""
    by_name: dict[str, torch.Tensor]
    numels: dict[str, int]
    """Per name of ``by_name``, its element count."""
    zeroed: list[torch.Tensor]
    """What ``clear`` zeroes: the allocations made for the layout, and the maps it took
    over from the interval it began in."""


class CastDetector:
    """Accumulates exact dirty bits per tensor between two syncs."""

    def __init__(self) -> None:
        self._dirty: dict[str, torch.Tensor] = {}
        self._numels: dict[str, int] = {}
        """Per name in ``_dirty``, its element count when first recorded (the map's bytes
        do not tell 1,020 elements from 1,024)."""
        self._first_seen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        """First-seen flips recorded one tensor at a time (indices, old values)."""
        self._runs: list[ChangeRun] = []
        """First-seen flips of the fused passes, as the kernels wrote them."""
        self._fused_passes = 0
        self._kept: layout.Layout | None = None
        self._maps: _Maps | None = None

    def record(self, name: str, master: torch.Tensor, model: torch.Tensor) -> None:
        """Mark what the coming ``model.copy_(master)`` will change; call it before the copy."""
        self.record_all({name: (master, model)})

    def record_and_copy(self, name: str, master: torch.Tensor, model: torch.Tensor) -> None:
        """``record`` then ``model.copy_(master)``: one pass on CUDA, the two calls elsewhere."""
        self.record_and_copy_all({name: (master, model)})

    def record_all(self, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``record`` for every ``name: (master, model)``; on CUDA all in one fused pass."""
        self._record_all(pairs, copy=False)

    def record_and_copy_all(self, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
                            ) -> None:
        """``record_and_copy`` for every ``name: (master, model)``: on CUDA one fused pass
        over all of them (a few launches, one host synchronisation per
        ``batch.GROUP_ELEMENTS`` elements), the two calls per tensor elsewhere."""
        self._record_all(pairs, copy=True)

    def _record_all(self, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]], *,
                    copy: bool) -> None:
        names = list(pairs)
        flat = list(itertools.chain.from_iterable(pairs.values()))
        masters, models = flat[::2], flat[1::2]
        kept = layout.keep(
            self._kept, layout.signature(flat, names, list(map(layout.DTYPE, flat))),
            lambda: map(_route, masters, models), kinds=2)
        if kept is not self._kept:  # sizes may have changed: before anything is written
            for name, model in zip(names, models):
                self._check_size(name, model.numel())
            self._kept = kept
        for at in kept.routes.get(layout.REFERENCE, ()):
            self._record(names[at], masters[at], models[at])
            if copy:
                models[at].copy_(masters[at])
        if not kept.fused:
            return
        from .cast_kernel import record

        maps = self._kept_maps(kept, names, models)
        for fused in kept.fused:
            members = list(zip(fused.pick(masters), fused.pick(models), fused.pick(maps)))
            if not fused.contiguous:
                members = [(master.detach().contiguous(), model, dirty)
                           for master, model, dirty in members]
            found = record(members, list(map(layout.DTYPE, fused.pick(models))), fused,
                           copy=copy)
            picked = fused.pick(names)
            self._runs += [run.named(picked) for run in found]
        self._fused_passes += 1

    def _kept_maps(self, kept: layout.Layout, names: list[str], models: list[torch.Tensor]
                   ) -> list[torch.Tensor | None]:
        """Per tensor of the call, its dirty map if the kernels take it (else None). The
        maps stay with their layout across ``clear`` (which zeroes them), so that their
        addresses, and with them the layout's plan, stay too; a new layout takes this
        interval's maps of its tensors and new zeroed ones for the others."""
        maps = self._maps
        if maps is None or maps.kept is not kept:
            zeroed = []
            for fused in kept.fused:
                picked = fused.pick(names)
                zeroed += [self._dirty[name] for name in picked if name in self._dirty]
                zeroed += self._new_dirty_maps({name: model for name, model in
                                                zip(picked, fused.pick(models))
                                                if name not in self._dirty})
            by_name = {names[at]: self._dirty[names[at]]
                       for fused in kept.fused for at in fused.positions}
            maps = self._maps = _Maps(kept, list(map(by_name.get, names)), by_name,
                                      {name: self._numels[name] for name in by_name}, zeroed)
        else:  # after a clear: the same maps, zeroed
            self._dirty.update(maps.by_name)
            self._numels.update(maps.numels)
        return maps.per_tensor

    def _check_size(self, name: str, numel: int) -> None:
        """``name``, if recorded in this interval, had ``numel`` elements then."""
        recorded = self._numels.get(name, numel)
        if recorded != numel:
            raise ResizedError(name, numel=numel, recorded=recorded)

    def _new_dirty_maps(self, models: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Zeroed dirty maps for ``models`` (of one device), views of one allocation, each
        starting on a 16-byte boundary (the kernels load aligned groups as vectors); the
        allocation, if any."""
        sizes = {name: -(-model.numel() // 8) for name, model in models.items()}
        padded = {name: -(-size // _MAP_ALIGN) * _MAP_ALIGN for name, size in sizes.items()}
        if not sizes:
            return []
        device = next(iter(models.values())).device
        flat = torch.zeros(sum(padded.values()), dtype=torch.uint8, device=device)
        start = 0
        for name, size in sizes.items():
            self._dirty[name] = flat[start:start + size]
            self._numels[name] = models[name].numel()
            start += padded[name]
        return [flat]

    def _record(self, name: str, master: torch.Tensor, model: torch.Tensor) -> None:
        flat = model.detach().reshape(-1)
        cast = master.detach().reshape(-1).to(model.dtype)
        # The NaN pattern a cast writes depends on torch's kernel path (bf16: 0x7FC0 from the
        # scalar and strided loops, 0xFFFF from the vectorised one), so NaN over NaN counts.
        flips = (int_bits(cast) != int_bits(flat)) | (torch.isnan(cast) & torch.isnan(flat))
        dirty = self._dirty.get(name)
        before = torch.zeros_like(flips) if dirty is None else _unpack(dirty, flips.numel())
        fresh = torch.nonzero(flips & ~before).view(-1)
        if fresh.numel():
            self._first_seen.setdefault(name, []).append(
                (fresh.to(index_dtype(flat.numel())), flat[fresh].clone()))
        self._dirty[name] = _pack(before | flips)
        self._numels[name] = flips.numel()

    def changes(self, name: str, model: torch.Tensor) -> ChangeSet:
        """Every element of ``model`` dirtied since the last ``clear``, with its old value."""
        seen = self._first_seen.get(name, [])
        for run in self._runs:
            member = run.member(name)
            if member is not None and run.counts[member]:
                found = run.change_set(member)
                seen = [*seen, (found.indices, found.base_low)]
        if not seen:
            return ChangeSet.empty(model)
        if len(seen) == 1:  # one recorded pass: sorted and unique already
            return ChangeSet.exact(seen[0][0].to(index_dtype(model.numel())), seen[0][1])
        indices = torch.cat([i for i, _ in seen])
        order = torch.argsort(indices)
        base = torch.cat([v for _, v in seen])[order]
        return ChangeSet.exact(indices[order].to(index_dtype(model.numel())), base)

    def changes_all(self, models: Mapping[str, torch.Tensor]) -> FlatChanges:
        """``changes`` of every ``name: model``, in ``models``' order. After one fused pass
        since the ``clear`` (a sync per optimizer step) the kernels' runs are passed on as
        they are (``FlatChanges``), so an encoder reads their buffers, not a view per
        tensor; a tensor with flips from several passes needs them merged, one by one."""
        runs = [run for run in self._runs if self._fused_passes == 1
                and all(n in models and n not in self._first_seen for n in run.names)]
        whole = {name for run in runs for name in run.names}
        return FlatChanges(tuple(models), runs, {name: self.changes(name, model)
                                                 for name, model in models.items()
                                                 if name not in whole})

    def clear(self) -> None:
        """Start a new interval (after a committed sync)."""
        self._dirty.clear()
        self._numels.clear()
        self._first_seen.clear()
        self._runs.clear()
        self._fused_passes = 0
        if self._maps is not None and self._maps.zeroed:
            torch._foreach_zero_(self._maps.zeroed)
