"""Host time of a fused detection's sync, with its kernels replaced, for each detector of
``--detectors``:

- inversion: ``AdamWSteps.changes_all``,
- cast: ``CastDetector.clear`` then ``record_and_copy_all``, over pairs built as a
  Megatron hook builds them (new flat views of the masters each sync),

each in two rows:

- front: what the GPU waits for before the first detection launch (``_mark``,
  ``_record``): the checks, the per-tensor bookkeeping, kernel configurations, the plan
  and the first group's scratch; the call as it runs, stopped by the kernel's stand-in
  at that launch.
- whole: the whole call (launch, pipelined sizing, each group's finish and the change
  sets handed back), with the Triton launches replaced by stand-ins (the detection
  kernel writes a fixed count per tile, ``_gather`` does nothing), over ``--groups``
  groups as a full-size model has (``batch.GROUP_ELEMENTS`` lowered).

Runs on the CPU: the tensors are CPU tensors of the Qwen3-4B count (290 by default; the
sizes do not matter, only the count) and ``dispatch.kernels_for`` is made to answer yes,
so that the timing is the Python around the kernels and nothing else. Only names that
``main`` has had since the fused inversion landed are used, so the same script times an
older tree (``PYTHONPATH`` pointing at its ``src``) for before/after.

``--evict-mb`` writes that much other memory before each call, so the call finds its
objects out of the caches, as in a training process after its step.

    uv run python tools/bench_detect_host.py --tensors 290 --reps 50 [--evict-mb 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dte_detector import CastDetector, batch, cast_kernel, dispatch, inversion_kernel, staging
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
    """Stands for ``_mark`` and ``_record``: each tile's count of changed elements is
    ``count``."""

    def __init__(self, count: int):
        self.count = count

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            args[7].fill_(self.count)  # the tile counts, after three tensors and the tables
        return launch


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=290)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--detectors", nargs="+", choices=("inversion", "cast"),
                        default=["inversion", "cast"])
    parser.add_argument("--evict-mb", type=int, default=0,
                        help="write this many MB of other memory before each call, as a "
                             "training step leaves the caches (0: warm caches)")
    args = parser.parse_args()
    evict = torch.zeros(args.evict_mb << 20, dtype=torch.uint8)
    torch.set_num_threads(1)
    dispatch.kernels_for = lambda *tensors, payload: True
    staging._gather = _NoLaunch()
    params = [torch.zeros(64 if i % 3 else 8) for i in range(args.tensors)]
    models = {f"w{i}": torch.zeros(p.shape, dtype=torch.bfloat16) for i, p in enumerate(params)}
    batch.GROUP_ELEMENTS = sum(p.numel() for p in params) // args.groups
    syncs = {"inversion": _inversion(params, models), "cast": _cast(params, models)}
    for detector in args.detectors:
        prepare, call, module, kernel = syncs[detector]
        for label, stand_in in (("front", _Stop()), ("whole", _Counts(2))):
            setattr(module, kernel, stand_in)
            samples = []
            for rep in range(args.reps + 3):
                prepare(rep + 1)
                evict.add_(1)
                start = time.perf_counter()
                try:
                    call()
                except _Launched:
                    pass
                samples.append((time.perf_counter() - start) * 1e3)
            samples = sorted(samples[3:])
            print(f"| {detector} host {label} | {args.tensors} tensors, {args.groups} groups | "
                  f"median {statistics.median(samples):.3f} ms | "
                  f"p90 {samples[int(0.9 * (len(samples) - 1))]:.3f} ms |")


def _inversion(params, models):
    """``AdamWSteps.changes_all`` after each step, and what it needs before."""
    steps = AdamWSteps(lambda param: [])
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]

    def stepped(step: int) -> None:
        """The state after optimizer step ``step``, as ``AdamWSteps.record`` keeps it: new
        state objects and step counts (so the kernels' configurations are new too), one
        step object for the one parameter group (as ``torch_adamw_states`` builds them)."""
        hyper = AdamWStep(lr=3e-6, weight_decay=0.003, step=step)
        for i, (param, (m, v)) in enumerate(zip(params, moments)):
            steps._stepped[f"w{i}"] = AdamWState(param, m, v, hyper)
            steps._synced[f"w{i}"] = step - 1

    return stepped, lambda: steps.changes_all(models), inversion_kernel, "_mark"


def _cast(params, models):
    """``CastDetector.clear`` and ``record_and_copy_all`` each sync, over pairs built anew."""
    detector = CastDetector()
    pairs = {}

    def built(step: int) -> None:
        pairs.clear()
        pairs.update({name: (param.detach().view(-1), model)
                      for param, (name, model) in zip(params, models.items())})

    def sync() -> None:
        detector.clear()
        detector.record_and_copy_all(pairs)

    return built, sync, cast_kernel, "_record"


if __name__ == "__main__":
    main()
