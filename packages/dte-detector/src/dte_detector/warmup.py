"""Compile the fused detection kernels before the first sync.

Triton compiles a kernel the first time it meets a specialisation (its ``constexpr``
arguments and which pointers are 16-byte aligned), ~0.7-0.9 s each: without a warm-up the
first delta sync of a model pays ~3.5 s. ``warm_up`` runs every specialisation a sync can
meet for a payload dtype on a few small tensors: decay factor one and not, a group whose
tensors are 16-byte aligned and one whose tensors are not (the kernels' two load paths),
tiles staged and tiles too dense to stage, and the cast with and without its copy. The
tables the kernels read are 16-byte aligned (``batch.py``) and the sizes, counts and
group shapes are runtime arguments, so a real model's sync reuses these compilations;
an unaligned group whose tensors are aligned in some kinds and not in others is the one
combination left to compile on first use.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from . import dispatch
from .cast import CastDetector
from .inversion import AdamWStep, Inversion, invert_adamw_all

_TILES = 3
"""Tiles of each warm-up tensor (of the largest tile shape): a few programs walk them."""
_ELEMENTS = _TILES * 1024 + 5
_STEP = {"lr": 0.1, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "step": 1}
"""A step that moves every element of the warm-up tensors: every tile is dense."""


def warm_up(device: torch.device | str, *,
            payloads: Iterable[torch.dtype] = (torch.bfloat16,)) -> None:
    """Compile the detection kernels for ``device`` and ``payloads`` (bf16 and/or fp16).

    Does nothing where the kernels do not run (a CPU device, no triton, inside
    ``dispatch.reference()``). Costs one compilation per specialisation, or a load from
    Triton's on-disk cache in a later process.
    """
    device = torch.device(device)
    probe = torch.empty(0, device=device)
    for payload in payloads:
        if not dispatch.kernels_for(probe, payload=payload):
            continue
        _invert(device, payload)
        _cast(device, payload)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pair(device: torch.device, dtype: torch.dtype, fill: float, *, aligned: bool
          ) -> torch.Tensor:
    """``_ELEMENTS`` values of ``fill``: a fresh (16-byte aligned) tensor, or a view one
    element into one (not aligned)."""
    whole = torch.full((_ELEMENTS + 1,), fill, dtype=dtype, device=device)
    return whole[:_ELEMENTS] if aligned else whole[1:]


def _invert(device: torch.device, payload: torch.dtype) -> None:
    inversions = []
    for aligned in (True, False):
        for weight_decay in (0.0, 0.1):  # decay factor one, and not
            master, exp_avg, exp_avg_sq = (_pair(device, torch.float32, fill, aligned=aligned)
                                           for fill in (1.0, 1.0, 1.0))
            inversions.append(Inversion(
                name=f"warm_up.{len(inversions)}", master=master, exp_avg=exp_avg,
                exp_avg_sq=exp_avg_sq, hyper=AdamWStep(weight_decay=weight_decay, **_STEP),
                previous_step=0, dtype=payload))
    invert_adamw_all(inversions)


def _cast(device: torch.device, payload: torch.dtype) -> None:
    for copy in (True, False):
        detector = CastDetector()
        pairs = {f"warm_up.{aligned}": (_pair(device, torch.float32, 1.0, aligned=aligned),
                                        _pair(device, payload, 0.0, aligned=aligned))
                 for aligned in (True, False)}
        if copy:
            detector.record_and_copy_all(pairs)
        else:
            detector.record_all(pairs)
