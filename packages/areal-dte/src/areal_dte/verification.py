"""Snapshot verification: every detector result checked against a retained copy.

Switched on by ``weight_update_delta_diagnostics.snapshot_verification``. The copy (a
`dte_detector.Snapshot` of the last committed model) costs the model's size again, which is
why it is a diagnostic: it catches a detector that misses a changed element or gives
old-value bounds that exclude the value the receiver holds, before the delta is sent,
instead of leaving it to the next anchor.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from dte_codec.bits import order_keys
from dte_detector import ChangeSet, Snapshot, diff
from dte_detector.changes import int_bits

from .errors import MissedChangeError


def check_changes(reference: Snapshot, model: Mapping[str, torch.Tensor],
                  found: Mapping[str, ChangeSet]) -> None:
    """Raise `MissedChangeError` for the first tensor whose ``found`` changes are unsound
    against the copies ``reference`` holds of the last committed ``model``."""
    for name, tensor in model.items():
        old = reference.reference(name)
        _check_tensor(name, old.reshape(-1), diff(old, tensor), found[name])


def _check_tensor(name: str, old: torch.Tensor, exact: ChangeSet, found: ChangeSet) -> None:
    reported = found.indices.to(torch.int64)
    missed = ~torch.isin(exact.indices.to(torch.int64), reported)
    width = old.element_size() * 8
    keys = [order_keys(int_bits(t.reshape(-1)), width)
            for t in (old[reported], found.base_low, found.base_high)]
    outside = (keys[0] < keys[1]) | (keys[0] > keys[2])
    if missed.any() or outside.any():
        example = (exact.indices[missed] if missed.any() else reported[outside])[0]
        raise MissedChangeError(name, missed=int(missed.sum()), outside=int(outside.sum()),
                                example=int(example))

