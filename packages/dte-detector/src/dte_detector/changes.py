"""The result every detector returns for one tensor."""

from __future__ import annotations

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
