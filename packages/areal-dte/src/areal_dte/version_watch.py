"""In-place writes to tensors that happened outside the actor, seen through version counters.

Every in-place write through a tensor (or a view or ``detach()`` of it) bumps autograd's
per-tensor version counter, ``Tensor._version``, grad mode or not: ``p.copy_``,
``p.mul_`` under ``no_grad``, ``Module.load_state_dict``, ``torch.nn.init``. Reading the
counters costs O(tensors), nothing per element, so the actor checks them at every step
and sync. Writes through ``p.data`` use a tensor with a counter of its own and are not
seen: that case is part of each detector's contract instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch


class VersionWatch:
    """Remembers the version counters of named tensors; says which moved since."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self._tensors = tensors
        self._seen = {name: t._version for name, t in tensors.items()}

    def mark(self, names: Iterable[str] | None = None) -> None:
        """Take the current counters of ``names`` (default all) as the reference."""
        for name in self._tensors if names is None else names:
            self._seen[name] = self._tensors[name]._version

    def moved(self) -> list[str]:
        """Names whose tensor was written since it was last marked."""
        return [name for name, t in self._tensors.items() if t._version != self._seen[name]]
