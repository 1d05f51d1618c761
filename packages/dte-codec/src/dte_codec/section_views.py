"""A payload's body cut into its entries' sections: views of the frame's segments
(a section across segments copied together), placed once per table and segment sizes.
"""

from __future__ import annotations

import bisect
import functools
import itertools

import torch

from .encodings import align
from .header import Header
from .table_bytes import TABLE_CACHE


def entry_sections(header: Header, segments: tuple[torch.Tensor, ...]
                   ) -> list[tuple[torch.Tensor, ...]]:
    """Per entry, its sections: views of the segment that holds each (a section across
    segments is copied together)."""
    table = header.sections()
    if len(segments) == 1:  # a delta's body: plain slices, no segment search
        body = segments[0]
        views = [body[at:at + size] for at, size in zip(table.offsets.tolist(), table.sizes)]
    else:
        # where each section lies depends only on the table and the segments' sizes, the
        # same for every full version of a stream; a section that is a whole segment (a
        # dense tensor) is that segment, no view made
        places = _places(table.sizes, tuple(s.numel() for s in segments))
        views = [segments[p] if p.__class__ is int else _cut(segments, p) for p in places]
    found = iter(views)
    return [tuple(itertools.islice(found, n)) for n in table.per_entry]


@functools.lru_cache(maxsize=TABLE_CACHE)
def _places(sizes: tuple[int, ...], segment_sizes: tuple[int, ...]
            ) -> tuple[int | tuple[int, int, int, int], ...]:
    """Per section of ``sizes`` (padded to the alignment, in body order) in a body made
    of segments of ``segment_sizes``: the index of the segment it is exactly, else
    (first segment, last segment, start, stop), start and stop counted from the first
    segment's start."""
    bounds = list(itertools.accumulate(segment_sizes, initial=0))
    places, pos = [], 0
    for size in sizes:
        first = bisect.bisect_right(bounds, pos) - 1
        if size == 0 or first == len(segment_sizes):
            places.append((0, -1, 0, 0))
        else:
            last = bisect.bisect_left(bounds, pos + size) - 1
            start = pos - bounds[first]
            whole = first == last and start == 0 and size == segment_sizes[first]
            places.append(first if whole else (first, last, start, start + size))
        pos += align(size)
    return tuple(places)


def _cut(segments: tuple[torch.Tensor, ...], place: tuple[int, int, int, int]
         ) -> torch.Tensor:
    """The bytes ``place`` (``_places``) of ``segments``: an empty section is an empty
    view of the first segment, one across segments is copied together."""
    first, last, start, stop = place
    if last < 0:
        return segments[0][:0] if segments else torch.empty(0, dtype=torch.uint8)
    joined = segments[first] if first == last else torch.cat(segments[first:last + 1])
    return joined[start:stop]
