"""Write a decoded payload into live tensors, all or nothing.

Two phases. Staging checks the payload against the receiver (names, dtypes, shapes,
coverage of a full payload), gathers the current values at the changed indices and
resolves the new values; nothing is written yet, so any ``CodecError`` there leaves the
tensors untouched. Writing scatters entry by entry and keeps the gathered values as an
O(changed) undo log; if a write fails, every touched tensor is restored before the
error propagates. Dense entries of a delta keep a copy of their tensor for the undo
log. A full payload keeps no undo log (it would be a second copy of the model): a write
failure there leaves the receiver without a valid version, which ``ApplyError`` says.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import attrs
import torch

from .decode import Payload
from .errors import ApplyError, MismatchError
from .header import Entry, Kind
from .values import decode_values


@attrs.frozen
class _Staged:
    """One entry ready to write: where, what, and how to undo it."""

    name: str
    flat: torch.Tensor
    indices: torch.Tensor | None
    new: torch.Tensor
    keep_undo: bool

    def saved(self) -> torch.Tensor | None:
        """What the undo log needs to restore this entry (None: no undo log)."""
        if self.indices is None:
            return self.flat.clone() if self.keep_undo else None
        return self.flat[self.indices]

    def write(self) -> None:
        """Write the new values."""
        if self.indices is None:
            self.flat.copy_(self.new)
        else:
            self.flat[self.indices] = self.new

    def undo(self, old: torch.Tensor) -> None:
        if self.indices is None:
            self.flat.copy_(old)
        else:
            self.flat[self.indices] = old


def apply_(weights: MutableMapping[str, torch.Tensor], payload: Payload) -> None:
    """Write ``payload`` into ``weights`` in place, all or nothing.

    Raises:
        MismatchError: the payload does not fit ``weights``; nothing was written.
        EntryError: a value does not decode against the receiver's base; nothing was written.
        ApplyError: a write failed; for a delta every tensor was restored, for a full
            payload the tensors hold a mix of versions (``rolled_back`` is False).
    """
    staged = [_stage(weights, entry, idx, sections, payload.header.kind)
              for entry, idx, sections in zip(payload.header.entries, payload.indices,
                                              payload.values)]
    _check_coverage(weights, payload)
    # An entry joins the undo log before its write starts, so a write that fails halfway
    # is restored too; no_grad lets the writes reach leaf tensors that require grad.
    undo: list[tuple[_Staged, torch.Tensor | None]] = []
    done = 0
    with torch.no_grad():
        try:
            for done, item in enumerate(staged):
                undo.append((item, item.saved()))
                item.write()
        except Exception as exc:
            full = payload.header.kind == Kind.FULL
            if not full:
                for item, old in reversed(undo):
                    item.undo(old)
            raise ApplyError(
                f"writing tensor {staged[done].name!r} failed after {done} of "
                f"{len(staged)} entries: {exc!r}; "
                + ("the tensors now mix versions" if full else "every tensor was restored")
            ) from exc


def _stage(weights: MutableMapping[str, torch.Tensor], entry: Entry,
           indices: torch.Tensor | None, sections: tuple[torch.Tensor, ...],
           kind: Kind) -> _Staged:
    target = weights.get(entry.name)
    if target is None:
        raise MismatchError("name", expected="a tensor of the receiver", got=entry.name)
    for field, expected, got in (("dtype", target.dtype, entry.dtype),
                                 ("shape", tuple(target.shape), entry.shape)):
        if expected != got:
            raise MismatchError(field, expected=expected, got=got, tensor=entry.name)
    if not target.is_contiguous():
        raise MismatchError("layout", expected="a contiguous tensor", got="strided",
                            tensor=entry.name)
    flat = target.view(-1)
    sections = tuple(s.to(target.device) for s in sections)
    if indices is None:
        new = sections[0].view(entry.dtype)
        return _Staged(entry.name, flat, None, new, keep_undo=kind == Kind.DELTA)
    indices = indices.to(target.device)
    new = decode_values(entry, sections, flat[indices])
    return _Staged(entry.name, flat, indices, new, keep_undo=True)


def _check_coverage(weights: MutableMapping[str, torch.Tensor], payload: Payload) -> None:
    if payload.header.kind != Kind.FULL:
        return
    missing = sorted(set(weights) - {e.name for e in payload.header.entries})
    if missing:
        raise MismatchError("entries", expected="every tensor of the receiver",
                            got=f"a full payload without {missing[:5]}")
