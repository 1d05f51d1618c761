"""Write decoded payloads into live tensors, all or nothing.

Two phases. Staging checks the payloads against the receiver (names, dtypes, shapes,
entries that overlap, coverage of a full version), gathers the current values at the
changed indices and resolves the new values (on a GPU every residue entry at once,
``flat_values``); nothing is written yet, so any
``CodecError`` there leaves the tensors untouched. Writing goes entry by entry and keeps
what each entry overwrites as an undo log, O(changed) for sparse entries (where the
kernels run, ``dispatch.fused``, every sparse entry of a device is one batch: one gather
launch for its undo log, one scatter launch for its values); if a write
fails, every touched tensor is restored before the error propagates. Dense and box
entries of a delta keep a copy of their region. A full version keeps no undo log (it
would be a second copy of the model): a write failure there leaves the receiver without
a valid version, which ``ApplyError`` says.

Several payloads of one version (one per sender rank, each covering part of the
receiver's tensors) apply as one transaction with ``apply_all``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING

import attrs
import torch

from .box_copy import StagedCopies, copies_by_name
from .dispatch import fused
from .encodings import Kind, ValueEncoding
from .entry import Entry
from .errors import ApplyError
from .fields import batched
from .fit import check_fit, check_window
from .flat_values import resolve_residues
from .payload import Payload
from .region import Box
from .values import decode_values

if TYPE_CHECKING:
    from .scatter_kernel import FlatEntries


@attrs.frozen
class Staged:
    """One write ready to go: into ``target`` (reported as ``name``), at flat indices
    ``where`` or inside the box ``where``, the values ``new``; ``keep_undo``: a box saves
    its old values first (a sparse write always does)."""

    name: str
    target: torch.Tensor
    where: torch.Tensor | Box
    new: torch.Tensor
    keep_undo: bool

    def _region(self) -> torch.Tensor:
        if isinstance(self.where, Box):
            return self.target[self.where.slices()]
        return self.target.view(-1)

    def saved(self) -> torch.Tensor | None:
        """What the undo log needs to restore this entry (None: no undo log)."""
        if isinstance(self.where, Box):
            return self._region().clone() if self.keep_undo else None
        return self._region()[self.where]

    def write(self) -> None:
        """Write the new values."""
        self._put(self.new)

    def undo(self, old: torch.Tensor) -> None:
        self._put(old)

    def _put(self, values: torch.Tensor) -> None:
        if isinstance(self.where, Box):
            self._region().copy_(values)
        else:
            self._region()[self.where] = values


def apply_(weights: MutableMapping[str, torch.Tensor], payload: Payload) -> None:
    """Write ``payload`` into ``weights`` in place, all or nothing (see ``apply_all``)."""
    apply_all(weights, [payload])


def apply_all(weights: MutableMapping[str, torch.Tensor], payloads: Sequence[Payload]) -> None:
    """Write the payloads of one version into ``weights`` in place, all or nothing.

    Raises:
        MismatchError: the payloads do not fit ``weights`` (names, dtypes, shapes,
            overlapping entries, a full version that leaves elements uncovered, payloads
            of different versions); nothing was written.
        EntryError: a value does not decode against the receiver's base; nothing written.
        ApplyError: a write failed; for a delta every tensor was restored, for a full
            version the tensors hold a mix of versions.
    """
    prepare(weights, payloads).write()


@attrs.frozen
class Prepared:
    """Payloads of one version checked against the receiver and resolved, not yet written.

    Lets a group of receivers agree that every one of them can apply its part before
    any of them writes.
    """

    entries: tuple[Staged | StagedBatch | StagedCopies, ...]
    full: bool

    def write(self, *, check: Callable[[], None] | None = None) -> None:
        """Write every entry; on failure restore a delta (see the module docstring).

        Args:
            check: runs once every entry is written (e.g. a digest comparison); if it
                raises, a delta is restored as for a failed write and the error
                propagates unchanged.
        """
        _write(list(self.entries), full=self.full, check=check)


def prepare(weights: Mapping[str, torch.Tensor], payloads: Sequence[Payload], *,
            held: Mapping[str, int] | None = None) -> Prepared:
    """Stage the payloads of one version (every check of ``apply_all``, no write);
    ``held`` as in ``check_fit``."""
    return _prepared(weights, payloads, check_fit(weights, payloads, held=held))


def prepare_window(weights: Mapping[str, torch.Tensor], payloads: Sequence[Payload]
                   ) -> Prepared:
    """Stage a window of a full version, the part of it that one round brings: every
    check of ``prepare`` but coverage, which ``check_covered`` makes once every window
    is in (a full version sent in bounded windows is written window by window).

    Raises:
        MismatchError: as ``prepare``, but for elements left uncovered; also for
            payloads that are not full.
    """
    return _prepared(weights, payloads, check_window(weights, payloads))


def _prepared(weights: Mapping[str, torch.Tensor], payloads: Sequence[Payload], kind: Kind
              ) -> Prepared:
    entries = [entry for payload in payloads
               for entry in zip(payload.header.entries, payload.indices, payload.values)]
    if kind == Kind.FULL:  # every entry a box (check_fit): one copy launch where it can
        copied = copies_by_name(weights, [(entry.name, where, sections[0])
                                          for entry, where, sections in entries])
        if copied is not None:
            return Prepared((copied,), True)
    items = [(weights[entry.name], entry, where, sections)
             for entry, where, sections in entries]
    groups: dict[torch.device, list[int]] = defaultdict(list)
    for k, (target, _, where, _) in enumerate(items):
        if isinstance(where, torch.Tensor) and fused(target.device):
            groups[target.device].append(k)
    staged: list[Staged | StagedBatch] = []
    for ks in groups.values():
        batch = _stage_batch([items[k] for k in ks])
        if batch is None:  # a residue that does not resolve: the reference raises its error
            staged += [_stage(*items[k], kind, None) for k in ks]
        else:
            staged.append(batch)
    taken = {k for ks in groups.values() for k in ks}
    rest = [k for k in range(len(items)) if k not in taken]
    resolved = _resolve_all(items, rest)
    if resolved is None:  # a residue that does not resolve: the reference raises its error
        resolved = {}
    staged += [_stage(*items[k], kind, resolved.get(k)) for k in rest]
    return Prepared(tuple(staged), kind == Kind.FULL)


@attrs.frozen
class StagedBatch:
    """Every sparse entry of one device, written by one scatter launch
    (``scatter_kernel``); the undo log is one gather launch."""

    entries: FlatEntries
    new: tuple[torch.Tensor, ...]

    @property
    def name(self) -> str:
        return f"{len(self.new)} sparse entries on {self.entries.device}"

    def saved(self) -> torch.Tensor:
        return self.entries.gather()

    def write(self) -> None:
        self.entries.scatter(self.new)

    def undo(self, old: torch.Tensor) -> None:
        self.entries.scatter(self.entries.views(old))


def _stage_batch(items: list[tuple[torch.Tensor, Entry, torch.Tensor, tuple[torch.Tensor, ...]]]
                 ) -> StagedBatch | None:
    """The sparse ``items`` of one device staged together: base values gathered in one
    launch, residues resolved against them (one host synchronization); None when one does
    not resolve."""
    from .scatter_kernel import FlatEntries
    device = items[0][0].device
    entries = FlatEntries([t for t, _, _, _ in items], [w.to(device) for _, _, w, _ in items])
    bases = entries.views(entries.gather())
    residue = [k for k, (_, e, _, _) in enumerate(items)
               if e.value_encoding == ValueEncoding.RESIDUE]
    new = [s[0].to(device).view(e.dtype) if e.value_encoding == ValueEncoding.RAW else None
           for _, e, _, s in items]
    if residue:
        values, failures = resolve_residues([items[k][1] for k in residue],
                                            [items[k][3] for k in residue],
                                            [bases[k] for k in residue])
        if int(failures):
            return None
        for k, value in zip(residue, values):
            new[k] = value
    return StagedBatch(entries, tuple(new))


def _resolve_all(items: list[tuple[torch.Tensor, Entry, torch.Tensor | Box,
                                   tuple[torch.Tensor, ...]]], ks: list[int]
                 ) -> dict[int, torch.Tensor] | None:
    """New values of the residue entries ``ks`` of ``items`` on a GPU, resolved together
    (``flat_values``) per device with one host synchronization each; None when one does
    not resolve. CPU entries resolve one by one in ``_stage`` (``fields.batched``)."""
    groups: dict[torch.device, list[int]] = defaultdict(list)
    for k in ks:
        target, entry = items[k][0], items[k][1]
        if entry.value_encoding == ValueEncoding.RESIDUE and batched(target.device):
            groups[target.device].append(k)
    resolved = {}
    for device, group in groups.items():
        bases = [items[k][0].view(-1).index_select(0, items[k][2].to(device)) for k in group]
        values, failures = resolve_residues([items[k][1] for k in group],
                                            [items[k][3] for k in group], bases)
        if int(failures):
            return None
        resolved.update(zip(group, values))
    return resolved


def _write(staged: list[Staged | StagedBatch], *, full: bool,
           check: Callable[[], None] | None) -> None:
    # An entry joins the undo log before its write starts, so a write that fails halfway
    # is restored too; no_grad lets the writes reach leaf tensors that require grad.
    undo: list[tuple[Staged | StagedBatch, torch.Tensor | None]] = []
    done = 0
    with torch.no_grad():
        try:
            for done, item in enumerate(staged):
                undo.append((item, item.saved()))
                item.write()
        except Exception as exc:
            if not full:
                _restore(undo)
            raise ApplyError(
                f"writing tensor {staged[done].name!r} failed after {done} of "
                f"{len(staged)} entries: {exc!r}; "
                + ("the tensors now mix versions" if full else "every tensor was restored")
            ) from exc
        if check is None:
            return
        try:
            check()
        except Exception:
            if not full:
                _restore(undo)
            raise


def _restore(undo: list[tuple[Staged | StagedBatch, torch.Tensor | None]]) -> None:
    for item, old in reversed(undo):
        item.undo(old)


def _stage(target: torch.Tensor, entry: Entry, where: torch.Tensor | Box,
           sections: tuple[torch.Tensor, ...], kind: Kind, new: torch.Tensor | None) -> Staged:
    if isinstance(where, Box):
        new = sections[0].to(target.device).view(entry.dtype).view(where.size)
        return Staged(entry.name, target, where, new, keep_undo=kind == Kind.DELTA)
    where = where.to(target.device)
    if new is None:
        sections = tuple(s.to(target.device) for s in sections)
        new = decode_values(entry, sections, target.view(-1)[where])
    return Staged(entry.name, target, where, new, keep_undo=True)
