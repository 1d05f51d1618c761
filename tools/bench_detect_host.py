"""Host time of the fused inversion's sync: ``AdamWSteps.changes_all`` with its kernels
replaced, in two rows.

- front: what the GPU waits for before its first ``_mark`` launch (the checks, the
  per-tensor bookkeeping, kernel configurations, the plan and the first group's scratch):
  the call as it runs, stopped by ``_mark``'s stand-in at that launch.
- whole: the whole call, ``invert_batch`` included (launch, pipelined sizing, each
  group's finish and the change sets handed back), with the Triton launches replaced by
  stand-ins (``_mark`` writes a fixed count per tile, ``_gather`` does nothing), over
  ``--groups`` groups as a full-size model has (``batch.GROUP_ELEMENTS`` lowered).

Runs on the CPU: the tensors are CPU tensors of the Qwen3-4B count (290 by default; the
sizes do not matter, only the count) and ``dispatch.kernels_for`` is made to answer yes,
so that the timing is the Python around the kernels and nothing else. Only names that
``main`` has had since the fused inversion landed are used, so the same script times an
older tree (``PYTHONPATH`` pointing at its ``src``) for before/after.

    uv run python tools/bench_detect_host.py --tensors 290 --reps 50
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dte_detector import batch, dispatch, inversion_kernel, staging
from dte_detector.inversion import AdamWStep
from dte_detector.steps import AdamWSteps
from dte_detector.torch_adamw import AdamWState


class _Launched(Exception):
    """Raised by ``_Stop``: the first kernel launch was reached."""


class _Stop:
    """Stands for ``_mark`` in the front row: ends the call at its first launch."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise _Launched
        return launch


class _Counts:
    """Stands for ``_mark``: each tile's count of changed elements is ``count``."""

    def __init__(self, count: int):
        self.count = count

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            args[7].fill_(self.count)  # the tile counts, after (p, m, v) and the group tables
        return launch


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=290)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dispatch.kernels_for = lambda *tensors, payload: True
    staging._gather = _NoLaunch()
    steps = AdamWSteps(lambda param: [])
    params = [torch.zeros(64 if i % 3 else 8) for i in range(args.tensors)]
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    models = {f"w{i}": torch.zeros(p.shape, dtype=torch.bfloat16) for i, p in enumerate(params)}
    batch.GROUP_ELEMENTS = sum(p.numel() for p in params) // args.groups

    def stepped(step: int) -> None:
        """The state after optimizer step ``step``, as ``AdamWSteps.record`` keeps it: new
        state objects and step counts (so the kernels' configurations are new too), one
        step object for the one parameter group (as ``torch_adamw_states`` builds them)."""
        hyper = AdamWStep(lr=3e-6, weight_decay=0.003, step=step)
        for i, (param, (m, v)) in enumerate(zip(params, moments)):
            steps._stepped[f"w{i}"] = AdamWState(param, m, v, hyper)
            steps._synced[f"w{i}"] = step - 1

    for label, mark in (("front", _Stop()), ("whole", _Counts(2))):
        inversion_kernel._mark = mark
        samples = []
        for rep in range(args.reps + 3):
            stepped(rep + 1)
            start = time.perf_counter()
            try:
                steps.changes_all(models)
            except _Launched:
                pass
            samples.append((time.perf_counter() - start) * 1e3)
        samples = sorted(samples[3:])
        print(f"| changes_all host {label} | {args.tensors} tensors, {args.groups} groups | "
              f"median {statistics.median(samples):.3f} ms | "
              f"p90 {samples[int(0.9 * (len(samples) - 1))]:.3f} ms |")


if __name__ == "__main__":
    main()
