"""dte-detector: which elements of the low-precision weights changed since the last sync.

Three detectors, each streaming one tensor at a time on the tensor's own device:
``diff``/``Snapshot`` (bitwise reference), ``invert_adamw`` (recovers the change set from
the post-step AdamW state, sound by a guard band) and ``CastDetector`` (exact dirty bits
at the fp32 -> bf16 cast, any optimizer, any number of steps).
"""

from .cast import CastDetector
from .changes import ChangeSet
from .errors import DetectorError
from .inversion import AdamWStep, invert_adamw
from .snapshot import Snapshot, diff
from .torch_adamw import AdamWState, torch_adamw_states

__all__ = [
    "AdamWState",
    "AdamWStep",
    "CastDetector",
    "ChangeSet",
    "DetectorError",
    "Snapshot",
    "diff",
    "invert_adamw",
    "torch_adamw_states",
]
