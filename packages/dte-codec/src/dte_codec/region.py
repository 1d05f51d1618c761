"""Unit-step boxes of a tensor: the regions that pieces of a layout and dense slices of a
payload cover."""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch

from .errors import EntryError, GeometryError


def int_tuple(value: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


def _check_box(box: Box, attribute: attrs.Attribute, size: tuple[int, ...]) -> None:
    if len(box.start) != len(size) or min(box.start + size, default=0) < 0:
        raise GeometryError("box", expected="start and size of equal length, >= 0",
                            got=f"start {box.start}, size {size}")


@attrs.frozen(cache_hash=True)
class Box:
    """The region ``start[d] <= i[d] < start[d] + size[d]`` of a tensor."""

    start: tuple[int, ...] = attrs.field(converter=int_tuple)
    size: tuple[int, ...] = attrs.field(converter=int_tuple, validator=_check_box)

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        """The box covering a whole tensor of ``shape``."""
        return cls((0,) * len(shape), shape)

    @property
    def stop(self) -> tuple[int, ...]:
        return tuple(s + n for s, n in zip(self.start, self.size))

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    @property
    def squeezed(self) -> tuple[int, ...]:
        """The box's shape without its size-1 dimensions (what element order depends on)."""
        return tuple(n for n in self.size if n != 1)

    def slices(self) -> tuple[slice, ...]:
        """Index a tensor with this to get the box as a strided view."""
        return tuple(slice(s, s + n) for s, n in zip(self.start, self.size))

    def inside(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.size) and all(e <= d for e, d in zip(self.stop, shape))

    def intersect(self, other: Box) -> Box:
        """The common box (``numel`` 0 when they do not overlap)."""
        start = tuple(max(a, b) for a, b in zip(self.start, other.start))
        stop = tuple(min(a, b) for a, b in zip(self.stop, other.stop))
        return Box(start, tuple(max(0, e - s) for s, e in zip(start, stop)))

    def overlaps(self, other: Box) -> bool:
        return self.intersect(other).numel > 0

    def contains(self, indices: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """Which flat ``indices`` of a tensor of ``shape`` lie inside this box."""
        inside = torch.ones_like(indices, dtype=torch.bool)
        rest = indices
        for dim in reversed(range(len(shape))):
            coord = rest % shape[dim] if shape[dim] else rest
            rest = rest // shape[dim] if shape[dim] else rest
            inside &= (coord >= self.start[dim]) & (coord < self.stop[dim])
        return inside

    def to_tensor(self) -> torch.Tensor:
        """The box as ``2 * ndim`` little-endian u64 (start, then size), as uint8."""
        return torch.tensor(self.start + self.size, dtype=torch.int64).view(torch.uint8)

    @classmethod
    def from_tensor(cls, section: torch.Tensor, shape: tuple[int, ...], *, tensor: str) -> Box:
        """Parse and validate a box section against the tensor's ``shape``."""
        fields = section.cpu().view(torch.int64).tolist()
        start, size = tuple(fields[: len(shape)]), tuple(fields[len(shape):])
        if not all(0 <= b and 0 < n and b + n <= d for b, n, d in zip(start, size, shape)):
            raise EntryError("box", expected=f"a non-empty box inside shape {shape}",
                             got=f"start {start}, size {size}", tensor=tensor)
        return cls(start, size)
