"""The body digest on a GPU: the Triton kernel against the torch reference, and its speed.

1. Correctness: for bodies of many sizes (partial last words, segments cut inside words,
   word positions past 2**32) the kernel's digest equals the torch reference run on the
   same device; the script exits 1 otherwise.
2. Speed over ``--gib`` GiB of bytes in ``--segments`` segments: the kernel, the torch
   reference (one chunk, scaled) and a device copy of the same bytes; the kernel's
   bandwidth over the bytes it reads, against the copy's (read + write).
3. A full frame of ``--gib`` GiB of bf16 weights: ``encode_full`` (views + digest),
   ``decode`` (digest check) and the apply copy, against a plain copy of all weights.

Prints one Markdown row per part and writes ``body_digest.json`` under ``--out``.

    python3 tools/gpu/check_body_digest.py --gib 8 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from dte_codec import apply_, decode, encode_full
from dte_codec.body_digest import CHUNK_WORDS, Run, as_words, body_digest, words_digest_torch
from dte_codec.body_digest_kernel import runs_digest_triton
from dte_codec.dispatch import reference


def timed(fn, reps: int = 5) -> float:
    """Median ms of ``fn()`` after one warm-up run."""
    fn()
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def check(gen: torch.Generator) -> int:
    """Cases where the kernel and the reference disagree, or where one flipped byte goes
    unseen (0 expected)."""
    bad = 0
    for size in (1, 3, 4, 7, 8, 4095, 4096 * 8 + 5, 1 << 20, (1 << 22) + 3, 3 << 24):
        body = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda", generator=gen)
        words = as_words(body)
        for first in (0, 1, 2**31 - 3, 2**32 + 11):
            runs = [Run(words, first), Run(words[: words.numel() // 3], first + 7)]
            torch_digest = int(sum(words_digest_torch(r.words, r.first_word) for r in runs))
            bad += int(runs_digest_triton(runs)) != torch_digest
        cuts = sorted(torch.randint(0, size + 1, (3,), generator=gen, device="cuda").tolist())
        pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, size])]
        digest = body_digest(pieces)
        with reference():
            bad += digest != body_digest(pieces)
        bad += digest != body_digest([body.cpu()])
        body[size // 2] ^= 1
        bad += digest == body_digest(pieces)
    return bad


def speed(gib: float, segments: int) -> dict:
    total = int(gib * 2**30) // segments // 8 * 8
    bodies = [torch.randint(0, 256, (total,), dtype=torch.uint8, device="cuda")
              for _ in range(segments)]
    copies = [torch.empty_like(b) for b in bodies]
    kernel = timed(lambda: body_digest(bodies))
    chunk = as_words(bodies[0])[:CHUNK_WORDS]
    torch_ms = timed(lambda: int(words_digest_torch(chunk, 0))) * (total * segments
                                                                   / chunk.numel() / 4)
    copy = timed(lambda: [c.copy_(b) for c, b in zip(copies, bodies)])
    nbytes = total * segments
    return {"bytes": nbytes, "kernel_ms": kernel, "torch_ms_scaled": torch_ms, "copy_ms": copy,
            "kernel_tbps": nbytes / kernel / 1e9, "copy_tbps": 2 * nbytes / copy / 1e9}


def full_frame(gib: float, tensors: int) -> dict:
    numel = int(gib * 2**30) // 2 // tensors // 4 * 4  # whole words: no padding segments
    weights = {f"w{i}": torch.randn(numel, device="cuda").to(torch.bfloat16)
               for i in range(tensors)}
    targets = {name: torch.empty_like(t) for name, t in weights.items()}
    frame = encode_full(weights, stream_id="s", version=1)
    ptrs_shared = all(s.data_ptr() == t.data_ptr() for s, t in zip(frame.segments,
                                                                    weights.values()))
    encode = timed(lambda: encode_full(weights, stream_id="s", version=1))
    decode_ms = timed(lambda: decode(frame))
    sync = timed(lambda: apply_(targets, decode(encode_full(weights, stream_id="s", version=1))))
    copy = timed(lambda: [targets[n].copy_(t) for n, t in weights.items()])
    same = all(torch.equal(targets[n].view(torch.int16), t.view(torch.int16))
               for n, t in weights.items())
    return {"bytes": 2 * numel * tensors, "segments_are_weights": ptrs_shared,
            "encode_ms": encode, "decode_ms": decode_ms, "full_sync_ms": sync, "copy_ms": copy,
            "ratio_to_copy": sync / copy, "bitwise": same}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=8.0)
    p.add_argument("--segments", type=int, default=290)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "mismatches": check(gen), "digest": speed(a.gib, a.segments)}
    results["full_frame"] = full_frame(a.gib, a.segments)
    d, f = results["digest"], results["full_frame"]
    print(f"| digest | {d['bytes'] / 1e9:.2f} GB in {a.segments} segments | kernel "
          f"{d['kernel_ms']:.2f} ms ({d['kernel_tbps']:.2f} TB/s read) | torch ~"
          f"{d['torch_ms_scaled']:.0f} ms | copy {d['copy_ms']:.2f} ms ({d['copy_tbps']:.2f} "
          f"TB/s r+w) | mismatches {results['mismatches']} |")
    print(f"| full frame | {f['bytes'] / 1e9:.2f} GB | encode {f['encode_ms']:.2f} ms | decode "
          f"{f['decode_ms']:.2f} ms | encode+decode+apply {f['full_sync_ms']:.2f} ms | copy "
          f"{f['copy_ms']:.2f} ms | x{f['ratio_to_copy']:.2f} | views {f['segments_are_weights']}"
          f" | bitwise {f['bitwise']} |")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "body_digest.json").write_text(json.dumps(results, indent=2))
    return 1 if results["mismatches"] or not f["bitwise"] else 0


if __name__ == "__main__":
    sys.exit(main())
