"""Recovery checkpoints of the actor: fp32 masters, AdamW state and the weight version.

Written after every committed sync when ``weight_update_delta_diagnostics.recovery`` is on
(one safetensors file, replaced atomically, so a crash leaves the previous checkpoint
whole); ``--resume DIR`` loads it. The rollout's weights are not saved: after a restart the
rollout is empty, and the first sync gives it the checkpoint's version in full.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    import torch

FILE = "actor.safetensors"
FOLDER = "checkpoint"
STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")


class CheckpointError(RuntimeError):
    """No usable checkpoint at the path given to ``--resume``."""


@attrs.frozen(kw_only=True)
class Saved:
    """What a checkpoint says about where the run stopped."""

    version: int
    """The weight version the masters hold (synced and committed before the save)."""
    steps: int
    """Optimizer steps taken (version 1 is the initial weights, before any step)."""


def locate(path: Path) -> Path:
    """The checkpoint file in `path`: a run's ``--out`` folder, its checkpoint folder, or
    the file itself.

    Raises:
        CheckpointError: none of those exists.
    """
    for candidate in (path / FOLDER / FILE, path / FILE, path):
        if candidate.is_file():
            return candidate
    raise CheckpointError(f"no checkpoint in {path}: expected {path / FOLDER / FILE} "
                          f"(written when weight_update_delta_diagnostics.recovery=true)")


def save(folder: Path, masters: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer,
         *, saved: Saved) -> Path:
    """Write the masters and ``optimizer``'s per-parameter state to ``folder/actor.safetensors``."""
    from safetensors.torch import save_file  # noqa: PLC0415 - torch only in the actor

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"master/{name}": p.detach().contiguous() for name, p in masters.items()}
    for name, p in masters.items():
        for key, value in optimizer.state.get(p, {}).items():
            tensors[f"{key}/{name}"] = value.detach().contiguous()
    target = folder / FILE
    partial = target.with_suffix(".partial")
    save_file(tensors, partial, metadata={"version": str(saved.version),
                                          "steps": str(saved.steps)})
    os.replace(partial, target)
    return target


def load(path: Path, masters: Mapping[str, torch.nn.Parameter],
         optimizer: torch.optim.Optimizer) -> Saved:
    """Fill ``masters`` and ``optimizer``'s state from the checkpoint at ``path``.

    Raises:
        CheckpointError: no checkpoint there, or it does not match these parameters.
    """
    import torch  # noqa: PLC0415 - torch only in the actor
    from safetensors.torch import safe_open  # noqa: PLC0415

    file = locate(path)
    with safe_open(file, framework="pt") as handle:  # one read: metadata and tensors
        meta = handle.metadata()
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    missing = sorted(n for n in masters if f"master/{n}" not in tensors)
    if missing:
        raise CheckpointError(f"{file} lacks parameters {missing[:3]}: another model?")
    with torch.no_grad():
        for name, p in masters.items():
            p.copy_(tensors[f"master/{name}"])
            state = {k: tensors[f"{k}/{name}"] for k in STATE_KEYS if f"{k}/{name}" in tensors}
            if state:
                optimizer.state[p] = state
    return Saved(version=int(meta["version"]), steps=int(meta["steps"]))
