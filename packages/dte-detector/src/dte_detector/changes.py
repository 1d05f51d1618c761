"""The result every detector returns for one tensor, and the flat form a batched
detection returns for many (``ChangeRun``, ``FlatChanges``)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Mapping, Sequence

import attrs
import torch

INDEX32_LIMIT = 2**31
_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}


@attrs.frozen
class ChangeSet:
    """Changed elements of one tensor, with what the sender knows about their old values.

    ``indices`` are sorted, unique flat indices (int32 when the tensor has fewer than 2**31
    elements, else int64) and may over-report, never miss. ``base_low``/``base_high``
    bound, per index, the value the receiver still holds, in the tensor's dtype and in
    the total order of its bit patterns (-0 below +0); they are equal when exact.
    """

    indices: torch.Tensor
    base_low: torch.Tensor
    base_high: torch.Tensor

    @classmethod
    def exact(cls, indices: torch.Tensor, base: torch.Tensor) -> ChangeSet:
        """A change set whose old values are known exactly."""
        return cls(indices, base, base)

    @classmethod
    def empty(cls, like: torch.Tensor, *, dtype: torch.dtype | None = None) -> ChangeSet:
        """No change in ``like``; bounds in ``dtype`` (the payload's, default ``like``'s)."""
        none = torch.empty(0, dtype=dtype or like.dtype, device=like.device)
        return cls(torch.empty(0, dtype=index_dtype(like.numel()), device=like.device), none,
                   none)

    def __len__(self) -> int:
        return self.indices.numel()


@attrs.frozen(eq=False, slots=False)
class ChangeRun:
    """The change sets of several tensors back to back, as a batched detector writes them:
    member ``k``'s are the ``counts[k]`` entries of ``indices``, ``base_low`` and
    ``base_high`` after those of the members before it. An encoder reads a run through
    its three buffers and the counts instead of a tensor call per member."""

    names: tuple
    """The members' keys: names in a ``FlatChanges``, positions as a detector writes them."""
    counts: tuple[int, ...]
    indices: torch.Tensor
    base_low: torch.Tensor
    base_high: torch.Tensor
    starts: tuple[int, ...] = attrs.field(init=False)
    """Each member's first entry."""

    @starts.default
    def _starts(self) -> tuple[int, ...]:
        return tuple(itertools.accumulate(self.counts[:-1], initial=0)) if self.counts else ()

    def change_set(self, member: int) -> ChangeSet:
        """Member ``member``'s change set (views of the run's buffers)."""
        start, count = self.starts[member], self.counts[member]
        return ChangeSet(*(t[start:start + count]
                           for t in (self.indices, self.base_low, self.base_high)))

    def member(self, name: object) -> int | None:
        """The position of member ``name``, or None."""
        return self._positions.get(name)

    @functools.cached_property
    def _positions(self) -> dict:
        return {name: k for k, name in enumerate(self.names)}

    def named(self, keys: Sequence) -> ChangeRun:
        """This run with member ``k`` keyed ``keys[self.names[k]]`` (positions to names)."""
        return ChangeRun(tuple(keys[at] for at in self.names), self.counts, self.indices,
                         self.base_low, self.base_high)


class FlatChanges(Mapping[str, ChangeSet]):
    """Per tensor name its ``ChangeSet``, as a batched detection found them: the members
    of ``runs`` as views of the runs' buffers, the others (``loose``) one by one. Reading
    a member builds its views (once); an encoder that knows runs reads ``runs`` and ``loose``
    instead (``dte_codec``'s flat encoder), and sends the same bytes.

    Args:
        names: every name, in the mapping's order.
        runs: runs keyed by name; a name is in at most one run and then not in ``loose``.
        loose: the change sets of the names in no run.
    """

    def __init__(self, names: Sequence[str], runs: Sequence[ChangeRun],
                 loose: Mapping[str, ChangeSet]):
        self.runs = tuple(runs)
        self.loose = dict(loose)
        self._names = tuple(names)
        self._members = {name: (run, k) for run in self.runs for k, name in enumerate(run.names)}
        self._built: dict[str, ChangeSet] = {}
        """The views read so far: a caller reading a name again gets the same object."""
        assert (len(self._members) + len(self.loose) == len(self._names)
                and self._members.keys().isdisjoint(self.loose)), \
            "every name in exactly one run or loose"

    def __getitem__(self, name: str) -> ChangeSet:
        found = self.loose.get(name)
        if found is None:
            found = self._built.get(name)
        if found is None:
            run, member = self._members[name]
            found = self._built[name] = run.change_set(member)
        return found

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self.loose or name in self._members


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < INDEX32_LIMIT else torch.int64


def int_bits(values: torch.Tensor) -> torch.Tensor:
    """The same bytes as the signed integer type of equal width (bitwise comparisons)."""
    return values.view(_INT_VIEW[values.element_size()])


def unknown_bounds(dtype: torch.dtype, count: int, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds that admit any old value: the lowest and highest patterns in total order."""
    width = torch.empty((), dtype=dtype).element_size() * 8
    ints = _INT_VIEW[width // 8]
    low = torch.full((count,), -1, dtype=ints, device=device)  # all ones: negative NaN, lowest
    high = torch.full((count,), (1 << (width - 1)) - 1, dtype=ints, device=device)
    return low.view(dtype), high.view(dtype)
