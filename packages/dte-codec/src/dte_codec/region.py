"""Unit-step boxes of a tensor: the regions dense slices cover."""

from __future__ import annotations

import math

import attrs
import torch

from .errors import EntryError


@attrs.frozen
class Box:
    """The region ``start[d] <= i[d] < start[d] + size[d]`` of a tensor."""

    start: tuple[int, ...]
    size: tuple[int, ...]

    @classmethod
    def whole(cls, shape: tuple[int, ...]) -> Box:
        return cls(tuple(0 for _ in shape), tuple(shape))

    @property
    def volume(self) -> int:
        return math.prod(self.size)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(b, b + n) for b, n in zip(self.start, self.size))

    def overlaps(self, other: Box) -> bool:
        return all(a < c + m and c < a + n
                   for a, n, c, m in zip(self.start, self.size, other.start, other.size))

    def contains(self, indices: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """Which flat ``indices`` of a tensor of ``shape`` lie inside this box."""
        inside = torch.ones_like(indices, dtype=torch.bool)
        rest = indices
        for dim in reversed(range(len(shape))):
            coord = rest % shape[dim] if shape[dim] else rest
            rest = rest // shape[dim] if shape[dim] else rest
            inside &= (coord >= self.start[dim]) & (coord < self.start[dim] + self.size[dim])
        return inside

    def to_tensor(self) -> torch.Tensor:
        """The box as ``2 * ndim`` little-endian u64 (start, then size), as uint8."""
        return torch.tensor(self.start + self.size, dtype=torch.int64).view(torch.uint8)

    @classmethod
    def from_tensor(cls, section: torch.Tensor, shape: tuple[int, ...], *, tensor: str) -> Box:
        """Parse and validate a box section against the tensor's ``shape``."""
        fields = section.cpu().view(torch.int64).tolist()
        start, size = tuple(fields[: len(shape)]), tuple(fields[len(shape):])
        ok = all(0 <= b and 0 < n and b + n <= d for b, n, d in zip(start, size, shape))
        if not ok:
            raise EntryError("box", expected=f"a non-empty box inside shape {shape}",
                             got=f"start {start}, size {size}", tensor=tensor)
        return cls(start, size)
