"""dte-detector: which elements of the low-precision weights changed since the last sync.

Three detectors, on the tensors' own device (on CUDA the fused kernels take all tensors
of a sync at once: ``invert_adamw_all``, ``CastDetector.record_and_copy_all``):
``diff``/``Snapshot`` (bitwise reference), ``invert_adamw`` (recovers the change set from
the post-step AdamW state, sound by a guard band) and ``CastDetector`` (exact dirty bits
at the fp32 -> bf16 cast, any optimizer, any number of steps). ``warm_up`` compiles the
kernels before the first sync.
"""

from .cast import CastDetector
from .changes import ChangeRun, ChangeSet, FlatChanges
from .errors import DetectorError
from .inversion import AdamWStep, Inversion, invert_adamw, invert_adamw_all
from .snapshot import Snapshot, diff
from .torch_adamw import AdamWState, torch_adamw_states
from .warmup import warm_up

__all__ = [
    "AdamWState",
    "AdamWStep",
    "CastDetector",
    "ChangeRun",
    "ChangeSet",
    "DetectorError",
    "FlatChanges",
    "Inversion",
    "Snapshot",
    "diff",
    "invert_adamw",
    "invert_adamw_all",
    "torch_adamw_states",
    "warm_up",
]
