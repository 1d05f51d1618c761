"""A decoded payload (``Payload``) and the one-body form the batched decoder gives it
(``Flat``): what ``decode`` returns and ``apply_`` and the receivers read.
"""

from __future__ import annotations

import functools

from typing import TYPE_CHECKING

import attrs
import numpy as np
import torch

from .flat_decode import INDEX_SECTIONS, VALUE_SECTIONS, FlatIndices
from .header import Header
from .region import Box
from .section_views import entry_sections

if TYPE_CHECKING:
    from .decode import QueuedChecks


@attrs.frozen(kw_only=True)
class Payload:
    """A decoded payload: its header and, per entry, validated indices and value sections.

    Built with ``indices`` and ``values`` (entry by entry), or with ``flat`` (the batched
    decoder), from which ``indices`` and ``values`` are made when first read. A payload of
    ``decode_queued`` may still have its checks queued (``checks``): reading ``indices``,
    ``values`` or ``flat`` reads them first and raises their error.
    """

    header: Header
    _indices: tuple[torch.Tensor | Box, ...] = ()
    _values: tuple[tuple[torch.Tensor, ...], ...] = ()
    _flat: Flat | None = None
    _checks: QueuedChecks | None = attrs.field(default=None, eq=False, repr=False)

    @functools.cached_property
    def indices(self) -> tuple[torch.Tensor | Box, ...]:
        """Per entry, int64 flat indices (sparse entries) or the box it covers (dense and
        box entries; a dense entry covers its whole tensor)."""
        settled = self.settled()
        if settled is not self:
            return settled.indices
        return self._indices if self._flat is None else self._flat.entry_indices()

    @functools.cached_property
    def values(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Per entry, the value sections as uint8 tensors (see ``FORMAT.md``)."""
        settled = self.settled()
        if settled is not self:
            return settled.values
        return self._values if self._flat is None else self._flat.entry_values()

    @property
    def flat(self) -> Flat | None:
        """The body in one piece and every sparse entry's indices back to back, where the
        batched decoder made them: what the kernels read, with no per-entry tensors."""
        settled = self.settled()
        return settled._flat if settled is self else settled.flat

    @property
    def checks(self) -> QueuedChecks | None:
        """The checks of a ``decode_queued`` payload while they are not read yet (None
        after): a reader may read them together with its own values (``unchecked_flat``)."""
        return None if self._checks is None or self._checks.read else self._checks

    def unchecked_flat(self) -> Flat | None:
        """``flat``, without reading ``checks`` while they are queued: only for launches
        that write scratch and read within the header's bounds, whose caller settles
        ``checks`` before using anything they made."""
        return self._flat if self.checks is not None else self.flat

    def settled(self) -> Payload:
        """This payload once its queued checks passed, or where the batched decode gave
        way, the payload decoded entry by entry; raises the decode's error otherwise.

        Raises:
            DigestError: the body does not match its digest.
            EntryError: invalid indices or escape positions inside an entry.
        """
        if self._checks is None:
            return self
        fallback = self._checks.settle()
        return self if fallback is None else fallback

    @property
    def nbytes(self) -> int:
        """Size of the body in bytes (the header is not counted)."""
        return self.header.body_size()


@attrs.frozen
class Flat:
    """A payload held as one body: where each section lies in it (``header.sections()``),
    and the indices of the sparse entries back to back."""

    header: Header
    body: torch.Tensor
    """The body, uint8, word aligned."""
    indices: FlatIndices
    regions: tuple[Box | None, ...]
    """Per entry, the box of a dense or box entry; None for a sparse entry."""

    def value_sections(self) -> tuple[np.ndarray, np.ndarray]:
        """Per entry, the body offsets of its value sections as three rows (raw values or
        residue fields, residue escape positions, escaped values; a row past an entry's
        last value section repeats that section's offset), and the size of its first."""
        sections = self.header.sections()
        firsts = sections.firsts
        last = np.append(firsts[1:], sections.offsets.size) - 1
        first_value = firsts + INDEX_SECTIONS[self.header.columns()["index_encoding"]]
        return (np.stack([sections.offsets[np.minimum(first_value + k, last)]
                          for k in range(VALUE_SECTIONS)]),
                sections.size_array[first_value])

    def entry_indices(self) -> tuple[torch.Tensor | Box, ...]:
        found = iter(self.indices.indices)
        return tuple(next(found) if region is None else region for region in self.regions)

    def entry_values(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        index_sections = INDEX_SECTIONS[self.header.columns()["index_encoding"]].tolist()
        return tuple(own[n:] for own, n in
                     zip(entry_sections(self.header, (self.body,)), index_sections))
