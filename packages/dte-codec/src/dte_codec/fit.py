"""Whether decoded payloads fit a receiver's tensors: the checks of ``apply.prepare`` that
read no values (one stream, kind and version; per entry a tensor of its name, dtype and
shape, contiguous; the entries of one tensor disjoint; a full version covering every
element). Each failure is a ``MismatchError``, raised before anything is written.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from .encodings import Kind
from .entry import Entry
from .errors import MismatchError
from .region import Box

if TYPE_CHECKING:
    from .payload import Payload


def check_fit(weights: Mapping[str, torch.Tensor], payloads: Sequence[Payload], *,
              held: Mapping[str, int] | None = None) -> Kind:
    """Every check of ``apply.prepare`` that reads no values: one stream, kind and version;
    per entry a tensor of that name, dtype and shape, contiguous; entries of one tensor
    disjoint; a full version covering every element. Meta tensors stand in for a
    receiver that holds its tensors in another layout.

    ``held``: per tensor, how many of its elements come from the model when that is
    fewer than all (a rollout rank's vocab padding rows, which no sender has); a full
    version must cover exactly that many. Default: every element.

    Returns:
        The payloads' kind.

    Raises:
        MismatchError: the first check that fails.
    """
    kind, regions = _fit(weights, payloads)
    _check_regions(weights, regions, kind, held or {})
    return kind


def check_window(weights: Mapping[str, torch.Tensor], payloads: Sequence[Payload]) -> Kind:
    """Every check of ``check_fit`` but coverage, for a window of a full version (the part
    of it that one round brings; ``check_covered`` checks coverage once every window is in).

    Returns:
        The payloads' kind: ``Kind.FULL``.

    Raises:
        MismatchError: as ``check_fit``, but for elements left uncovered; also for
            payloads that are not full.
    """
    kind, regions = _fit(weights, payloads)
    if kind != Kind.FULL:
        raise MismatchError("payloads", expected="full payloads in a window", got=kind.name)
    for name, wheres in regions.items():
        _check_disjoint(name, tuple(weights[name].shape), wheres)
    return kind


def check_covered(weights: Mapping[str, torch.Tensor],
                  regions: Mapping[str, Sequence[torch.Tensor | Box]], *,
                  held: Mapping[str, int] | None = None) -> None:
    """The regions (by tensor name) that every window of a full version brought are
    disjoint and cover every element of ``weights`` (``held`` as in ``check_fit``): the
    checks ``prepare_window`` leaves out.

    Raises:
        MismatchError: two regions overlap, or an element is left uncovered.
    """
    _check_regions(weights, {name: list(wheres) for name, wheres in regions.items()},
                   Kind.FULL, held or {})


def _fit(weights: Mapping[str, torch.Tensor], payloads: Sequence[Payload]
         ) -> tuple[Kind, dict[str, list[torch.Tensor | Box]]]:
    """One stream, kind and version; every entry's target fits; the regions by tensor (of
    a delta only those of tensors that several entries reach: a tensor's one entry
    overlaps nothing, and a delta covers nothing in particular)."""
    kind = _check_same_version(payloads)
    for payload in payloads:
        for entry in payload.header.entries:
            _check_target(weights, entry)
    shared = {name for name, n in Counter(entry.name for payload in payloads
                                          for entry in payload.header.entries).items() if n > 1}
    regions: dict[str, list[torch.Tensor | Box]] = defaultdict(list)
    for payload in payloads:
        if kind == Kind.DELTA and shared.isdisjoint(e.name for e in payload.header.entries):
            continue  # its indices are not read (a batched decode makes them on demand)
        for entry, where in zip(payload.header.entries, payload.indices):
            if kind == Kind.FULL or entry.name in shared:
                regions[entry.name].append(where)
    return kind, regions


def _check_same_version(payloads: Sequence[Payload]) -> Kind:
    if not payloads:
        raise MismatchError("payloads", expected="at least one payload", got="none")
    keys = {(p.header.stream_id, p.header.kind, p.header.base_version, p.header.payload_version)
            for p in payloads}
    if len(keys) != 1:
        raise MismatchError("payloads", expected="one stream, kind and version",
                            got=sorted(keys, key=str))
    return payloads[0].header.kind


def _check_target(weights: Mapping[str, torch.Tensor], entry: Entry) -> None:
    target = weights.get(entry.name)
    if target is None:
        raise MismatchError("name", expected="a tensor of the receiver", got=repr(entry.name))
    # one comparison each in the common case: a full version checks every tensor
    if target.dtype != entry.dtype:
        raise MismatchError("dtype", expected=target.dtype, got=entry.dtype, tensor=entry.name)
    if target.shape != entry.shape:
        raise MismatchError("shape", expected=tuple(target.shape), got=entry.shape,
                            tensor=entry.name)
    check_contiguous(entry.name, target)


def check_contiguous(name: str, target: torch.Tensor) -> None:
    """Raise ``MismatchError`` where the tensor ``name`` is not contiguous: writes go
    through flat views of it."""
    if not target.is_contiguous():
        raise MismatchError("layout", expected="a contiguous tensor", got="strided", tensor=name)


def _check_regions(weights: Mapping[str, torch.Tensor],
                   regions: Mapping[str, list[torch.Tensor | Box]], kind: Kind,
                   held: Mapping[str, int]) -> None:
    """Entries of one tensor must not overlap; a full version must cover every element
    the receiver holds from the model."""
    for name, wheres in regions.items():
        _check_disjoint(name, tuple(weights[name].shape), wheres)
    if kind != Kind.FULL:
        return
    missing = sorted(n for n, t in weights.items() if t.numel() and n not in regions)
    if missing:
        raise MismatchError("entries", expected="every tensor of the receiver",
                            got=f"a full payload without {missing[:5]}")
    for name, wheres in regions.items():
        covered = sum(where.numel for where in wheres)
        expected = held.get(name, weights[name].numel())
        if covered != expected:
            raise MismatchError("entries", expected=f"{expected} elements covered",
                                got=covered, tensor=name)


def _check_disjoint(name: str, shape: tuple[int, ...],
                    wheres: list[torch.Tensor | Box]) -> None:
    if len(wheres) < 2:
        return
    boxes = [w for w in wheres if isinstance(w, Box)]
    for a, b in itertools.combinations(boxes, 2):
        if a.overlaps(b):
            raise MismatchError("entries", expected="disjoint regions",
                                got=f"boxes {a} and {b} overlap", tensor=name)
    lists = [w for w in wheres if not isinstance(w, Box)]
    if not lists:
        return
    indices = torch.cat(lists)
    if len(lists) > 1 and torch.unique(indices).numel() != indices.numel():
        raise MismatchError("entries", expected="disjoint regions",
                            got="an index sent twice", tensor=name)
    for box in boxes:
        if bool(box.contains(indices, shape).any()):
            raise MismatchError("entries", expected="disjoint regions",
                                got=f"an index inside box {box}", tensor=name)
