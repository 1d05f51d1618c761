"""Host time of the frame path: ``encode_full`` (parts, header, seal with its body digest)
and ``decode`` (header, body digest check) of a full version of many tiny tensors.

The tensors are so small that the device work is negligible, so the wall time is the
host's: Python per tensor, header pack/unpack/validate, kernel launches and the host
synchronizations. Only public ``dte_codec`` names are used, so the same script times an
older tree (``PYTHONPATH`` pointing at it) for before/after figures in one run.

    python3 tools/bench_frame_host.py --tensors 290 --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from dte_codec import decode, encode_full


def timed(fn, *, reps: int, device: torch.device) -> tuple[float, float]:
    """Median and p90 ms of ``fn()`` after two warm-up runs (the device synchronized
    around each run)."""
    fn(), fn()
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - start) * 1e3)
    samples.sort()
    return statistics.median(samples), samples[int(0.9 * (len(samples) - 1))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensors", type=int, default=290)
    p.add_argument("--numel", type=int, default=256, help="bf16 elements per tensor")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--label", default="")
    a = p.parse_args()
    device = torch.device(a.device)
    weights = {f"model.layers.{i}.weight": torch.randn(a.numel, device=device).bfloat16()
               for i in range(a.tensors)}
    frame = encode_full(weights, stream_id="s", version=1)
    encode = timed(lambda: encode_full(weights, stream_id="s", version=1), reps=a.reps,
                   device=device)
    check = timed(lambda: decode(frame), reps=a.reps, device=device)
    print(f"| frame host {a.label} | {a.tensors} x {a.numel} bf16 on {a.device} | encode_full "
          f"{encode[0]:.2f} ms (p90 {encode[1]:.2f}) | decode {check[0]:.2f} ms (p90 "
          f"{check[1]:.2f}) |")


if __name__ == "__main__":
    main()
