"""Where the change set of each tensor of a set lies, as numpy columns: the fused encoder
reads indices and bounds in place through these addresses.

A batched detection hands its change sets over as runs (``dte_detector.FlatChanges``):
per group of tensors one indices buffer and two bounds buffers, the members back to
back, with their counts known on the host. A run's columns follow with numpy from its
three base addresses and the counts, and the checks a change set must pass (index
dtype, bounds' dtype and length, device, contiguity) are made once per run, not per
tensor. Change sets given one by one (any other ``Mapping``, and a ``FlatChanges``'
``loose`` ones) are read one by one. Either way the columns, so the bytes, are the same.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import attrs
import numpy as np
import torch

if TYPE_CHECKING:
    from .encode import ChangeSet
    from .tensor_set import TensorSet

_INDEX_DTYPES = (torch.int32, torch.int64)


class ChangeRun(Protocol):
    """Change sets of tensors ``names`` back to back (``dte_detector.ChangeRun``)."""

    names: tuple[str, ...]
    counts: tuple[int, ...]
    starts: tuple[int, ...]
    indices: torch.Tensor
    base_low: torch.Tensor
    base_high: torch.Tensor


def parts(changes: Mapping[str, ChangeSet]) -> tuple[Sequence[ChangeRun], Mapping[str, ChangeSet]]:
    """The runs of ``changes`` and the change sets outside them (all of a plain mapping)."""
    runs = getattr(changes, "runs", ())
    return (runs, changes.loose) if runs else ((), changes)


@attrs.frozen(eq=False)
class Members:
    """Every member of a sync's runs, in run order, as columns."""

    runs: Sequence[ChangeRun]
    at: np.ndarray
    """Its tensor's position in the set."""
    count: np.ndarray
    start: np.ndarray
    """Its first entry in its run's buffers."""
    run: np.ndarray
    """Its run's position in ``runs``."""

    @classmethod
    def of(cls, known: TensorSet, runs: Sequence[ChangeRun]) -> Members | None:
        """The members of ``runs``, or None when a run's counts do not match its names."""
        if any(len(run.counts) != len(run.names) or len(run.starts) != len(run.names)
               for run in runs):
            return None
        at, run = _placed(known, tuple(run.names for run in runs))

        def column(field: str) -> np.ndarray:
            return np.fromiter(itertools.chain.from_iterable(getattr(run, field) for run in runs),
                               np.int64, len(at))
        return cls(runs, at, column("counts"), column("starts"), run)


def _placed(known: TensorSet, names: tuple[tuple[str, ...], ...]) -> tuple[np.ndarray, np.ndarray]:
    """The ``at`` and ``run`` columns of runs of members ``names``: a detector groups the
    same tensors the same way sync after sync, so the last grouping's columns are kept
    on the tensor set (which a replaced tensor rebuilds), and a sync compares the names."""
    kept = known.caches.get(Members)
    if kept is None or kept[0] != names:
        flat = [name for run in names for name in run]
        kept = known.caches[Members] = (names, known.rows(flat),
                                        np.repeat(np.arange(len(names)), [len(n) for n in names]))
    return kept[1], kept[2]


def change_counts(known: TensorSet, members: Members, loose: Mapping[str, ChangeSet]
                  ) -> np.ndarray:
    """Per tensor of ``known``, how many elements its change set holds."""
    count = np.zeros(len(known.names), np.int64)
    count[members.at] = members.count
    if loose:
        count[known.rows(list(loose))] = [c.indices.numel() for c in loose.values()]
    return count


@attrs.frozen(eq=False)
class ChangeTable:
    """Per tensor of a set (a column entry per row; zero where it has no change), the
    addresses of its change set's indices, index itemsize and bounds."""

    columns: np.ndarray
    """Rows ``COLUMNS``, a column per tensor."""
    keep: tuple
    """The tensors the addresses point into: kept alive until the kernels are queued."""

    COLUMNS = ("index_at", "index_size", "low_at", "high_at")

    @classmethod
    def of(cls, known: TensorSet, members: Members, loose: Mapping[str, ChangeSet],
           count: np.ndarray, device: torch.device) -> ChangeTable | None:
        """The table of change sets whose counts are ``count`` (``change_counts``), or
        None when one does not fit its tensor (wrong dtype, length or device, checked
        here without reading a device value); the caller then takes the reference path,
        which raises the error."""
        columns = np.zeros((len(cls.COLUMNS), len(known.names)), np.int64)
        runs = members.runs
        if runs:
            if not all(_run_fits(run, device) for run in runs):
                return None
            ids = known.dtype_ids
            base = np.array([(ids.get(run.base_low.dtype, -1), run.indices.data_ptr(),
                              run.indices.element_size(), run.base_low.data_ptr(),
                              run.base_high.data_ptr(), run.base_low.element_size())
                             for run in runs], np.int64)
            dtype, index_at, size, low_at, high_at, item = base[members.run].T
            if (known.dtype_column[members.at] != dtype).any():
                return None  # bounds in another dtype than their tensor's
            start = members.start
            columns[:, members.at] = [index_at + start * size, size, low_at + start * item,
                                      high_at + start * item]
        keep: list[object] = list(runs)
        row, dtypes = known.row, known.table.dtypes
        at, found = [], []
        for name, change in loose.items():
            r = row[name]
            if count[r]:
                if not _bounds_fit(dtypes[r], int(count[r]), change):
                    return None
                indices = _indices(change, device)
                low, high = _in_place(change.base_low, device), _in_place(change.base_high, device)
                at.append(r)
                found += [indices.data_ptr(), indices.element_size(), low.data_ptr(),
                          high.data_ptr()]
                keep.append((indices, low, high))
        if at:
            columns[:, at] = np.array(found, np.int64).reshape(-1, len(cls.COLUMNS)).T
        return cls(columns, tuple(keep))


def _run_fits(run: ChangeRun, device: torch.device) -> bool:
    """A run's buffers lie flat on ``device`` and hold every member's change set (the
    per-tensor checks of ``_bounds_fit`` and ``_indices`` but the dtype, made once)."""
    shape = (sum(run.counts),)
    index, low, high = run.indices, run.base_low, run.base_high
    # spelled out, a line per property of the three buffers, not looped over them: a call
    # per run and sync, and the loop's generator costs a quarter more (1.3 vs 1.0 us)
    return (index.dtype in _INDEX_DTYPES and high.dtype == low.dtype
            and index.shape == shape and low.shape == shape and high.shape == shape
            and index.device == device and low.device == device and high.device == device
            and index.is_contiguous() and low.is_contiguous() and high.is_contiguous())


def bounds_fit(dtypes: list[torch.dtype], counts: list[int], changes: Sequence) -> bool:
    """Every bound has its tensor's dtype and one value per index (the reference's checks
    that need no device value, besides those of the tensor set)."""
    return all(_bounds_fit(d, n, c) for d, n, c in zip(dtypes, counts, changes))


def _bounds_fit(dtype: torch.dtype, count: int, change: ChangeSet) -> bool:
    shape = (count,)
    return (change.base_low.dtype == dtype and change.base_high.dtype == dtype
            and change.base_low.shape == shape and change.base_high.shape == shape)


def _in_place(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``values`` as contiguous on ``device``: itself when it already is (the usual case;
    a call per tensor and sync counts, so no-op conversions are skipped)."""
    if values.device == device and values.is_contiguous():
        return values
    return values.to(device).contiguous()


def _indices(change: ChangeSet, device: torch.device) -> torch.Tensor:
    indices = change.indices
    if indices.dtype not in _INDEX_DTYPES:
        indices = indices.to(torch.int64)
    return _in_place(indices, device)


def changed_elements(changes: Mapping[str, ChangeSet]) -> int:
    """How many elements ``changes`` hold in all (a run's from its counts, with no view
    built per tensor)."""
    runs, loose = parts(changes)
    return (sum(sum(run.counts) for run in runs)
            + sum(c.indices.numel() for c in loose.values()))
