"""The reference detector: a bitwise diff against a retained copy."""

from __future__ import annotations

import torch

from .changes import ChangeSet, index_dtype, int_bits
from .errors import NoReferenceError


def diff(old: torch.Tensor, new: torch.Tensor) -> ChangeSet:
    """Elements whose bit patterns differ between ``old`` and ``new`` (same dtype and shape).

    Bits, not values: NaN payloads and -0.0 vs +0.0 count as changes.
    """
    if old.dtype != new.dtype or old.shape != new.shape:
        raise ValueError(f"diff needs equal dtype and shape, got {old.dtype}{tuple(old.shape)} "
                         f"and {new.dtype}{tuple(new.shape)}")
    flat_old = old.reshape(-1)
    changed = int_bits(flat_old) != int_bits(new.reshape(-1))
    indices = torch.nonzero(changed).view(-1)
    return ChangeSet.exact(indices.to(index_dtype(old.numel())), flat_old[indices])


class Snapshot:
    """Retains a copy of each tensor at the last committed sync and diffs against it.

    Costs a full copy of the weights: use it to verify the other detectors, or where
    memory is no concern.
    """

    def __init__(self) -> None:
        self._copies: dict[str, torch.Tensor] = {}

    def changes(self, name: str, tensor: torch.Tensor) -> ChangeSet:
        """Changes of ``tensor`` since ``retain`` was last called for ``name``."""
        return diff(self.reference(name), tensor)

    def reference(self, name: str) -> torch.Tensor:
        """The copy retained for ``name`` (read it, do not write it)."""
        if name not in self._copies:
            raise NoReferenceError(name)
        return self._copies[name]

    def retain(self, name: str, tensor: torch.Tensor, *, copy: bool = True) -> None:
        """Keep ``tensor`` as the reference for later diffs: a copy, or with
        ``copy=False`` the tensor itself, for a caller that hands over one it owns."""
        self._copies[name] = tensor.detach().clone() if copy else tensor.detach()

    def forget(self) -> None:
        """Drop every retained copy (e.g. after the receiver lost its base)."""
        self._copies.clear()
