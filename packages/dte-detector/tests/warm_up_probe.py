"""Run by ``test_kernels.py`` in a fresh process: how many kernels a detection workload
compiles, after ``warm_up`` (``warm``) or without it (``cold``). Prints one JSON line."""

from __future__ import annotations

import json
import sys

import torch

from dte_detector import AdamWStep, CastDetector, Inversion, invert_adamw_all, warm_up
from dte_detector import cast_kernel, inversion_kernel, staging

KERNELS = (inversion_kernel._mark, inversion_kernel._dense, staging._gather,
           cast_kernel._record, cast_kernel._record_dense)
PAYLOADS = (torch.bfloat16, torch.float16)


def compiled() -> int:
    return sum(len(caches[0]) for k in KERNELS for caches in k.device_caches.values())


def tensor(numel: int, dtype: torch.dtype, *, aligned: bool, gen) -> torch.Tensor:
    whole = torch.rand(numel + 1, device="cuda", generator=gen).to(dtype)
    return whole[:numel] if aligned else whole[1:]


def workload(sizes: tuple[int, ...], seed: int) -> None:
    """Inversions and casts over ``sizes``: both payloads, aligned and not, decay one and
    not, a small step (staged tiles) and a large one (dense tiles), cast with and without
    its copy."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    inversions = []
    for n in sizes:
        for payload in PAYLOADS:
            for aligned in (True, False):
                for weight_decay, lr in ((0.0, 1e-3), (0.1, 1e-3), (0.0, 0.1), (0.1, 0.1)):
                    p, m, v = (tensor(n, torch.float32, aligned=aligned, gen=gen)
                               for _ in range(3))
                    hyper = AdamWStep(lr=lr, weight_decay=weight_decay, beta1=0.9,
                                      beta2=0.999, eps=1e-8, step=3)
                    inversions.append(Inversion(name=str(len(inversions)), master=p,
                                                exp_avg=m, exp_avg_sq=v, hyper=hyper,
                                                previous_step=2, dtype=payload))
    invert_adamw_all(inversions)
    for copy in (True, False):
        pairs = {}
        for n in sizes:
            for payload in PAYLOADS:
                for aligned in (True, False):
                    master = tensor(n, torch.float32, aligned=aligned, gen=gen)
                    model = tensor(n, payload, aligned=aligned, gen=gen)
                    model[: n // 2] = master[: n // 2]  # half unchanged: staged and dense tiles
                    pairs[str(len(pairs))] = (master, model)
        detector = CastDetector()
        if copy:
            detector.record_and_copy_all(pairs)
        else:
            detector.record_all(pairs)
    torch.cuda.synchronize()


def main(mode: str) -> None:
    if mode == "warm":
        warm_up("cuda", payloads=PAYLOADS)
    before = compiled()
    workload((70001, 3, 5000), seed=1)
    first = compiled()
    workload((123457, 17, 2048, 999), seed=2)
    print(json.dumps({"before": before, "first": first, "second": compiled()}))


if __name__ == "__main__":
    main(sys.argv[1])
