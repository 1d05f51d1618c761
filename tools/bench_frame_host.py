"""Host time of the frame path: ``encode_full`` (parts, header, seal with its body digest)
and ``decode`` (header, body digest check) of a full version of many tiny tensors; and
the header of a delta (``--delta``): packed and validated by the sender, parsed, validated
and split into sections by the receiver, its entry table new every sync.

The tensors are so small that the device work is negligible, so the wall time is the
host's: Python per tensor, header pack/unpack/validate, kernel launches and the host
synchronizations. Only public ``dte_codec`` names are used, so the same script times an
older tree (``PYTHONPATH`` pointing at it) for before/after figures in one run.

    python3 tools/bench_frame_host.py --tensors 290 --device cuda
    python3 tools/bench_frame_host.py --tensors 290 --delta
"""

from __future__ import annotations

import argparse
import statistics
import struct
import time

import torch
from dte_codec import decode, encode_full
from dte_codec.encodings import IndexEncoding, Kind, ValueEncoding
from dte_codec.entry import Entry
from dte_codec.header import DIGEST_OFFSET, Header, header_digest
from dte_codec.parts import checked_header
from dte_codec.section_views import entry_sections


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


_SPARSE = ((IndexEncoding.INT32, 0, 0), (IndexEncoding.GAP8, 0, 1),
           (IndexEncoding.BITMAP, 0, 0), (IndexEncoding.ELIAS_FANO, 7, 0))


def delta_entries(tensors: int, sync: int) -> tuple[Entry, ...]:
    """A delta's table of contents as a Qwen3-4B-shaped sender makes it: every encoding
    and both value encodings, counts that differ from sync to sync (no cache hits)."""
    entries = []
    for i in range(tensors):
        shape = (2560, 9728) if i % 3 else (2560,)
        numel = shape[0] * (shape[-1] if len(shape) > 1 else 1)
        count = 1 + (i * 7919 + sync * 104729) % max(numel // 1000, 1)
        index, width, escapes = _SPARSE[(i + sync) % len(_SPARSE)]
        residue = i % 2 == 0
        entries.append(Entry(
            name=f"model.layers.{i // 8}.mlp.proj_{i % 8}.weight", dtype=torch.bfloat16,
            shape=shape, count=count, index_encoding=index, index_width=width,
            index_escapes=min(escapes, count),
            value_encoding=ValueEncoding.RESIDUE if residue else ValueEncoding.RAW,
            value_width=5 if residue else 0, value_escapes=min(count, 3) if residue else 0))
    return tuple(entries)


def delta_header(tensors: int, reps: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """Median and least ms (the least is steadier on a shared host) of the sender's
    ``checked_header``, ``Header.pack`` and header digest (what ``seal`` adds is the body
    digest) and of the receiver's ``Header.unpack_head`` and ``entry_sections``, each sync
    with fresh entries of new counts."""
    send, receive = [], []
    for sync in range(reps + 2):
        entries = delta_entries(tensors, sync)
        start = time.perf_counter()
        header = checked_header(entries, stream_id="s", kind=Kind.DELTA, base_version=sync,
                                version=sync + 1)
        head = bytearray(header.pack())
        struct.pack_into("<Q", head, DIGEST_OFFSET, header_digest(head))
        sent = time.perf_counter()
        body = torch.empty(header.body_size(), dtype=torch.uint8)
        middle = time.perf_counter()
        parsed = Header.unpack_head(memoryview(head), body.numel())
        entry_sections(parsed, (body,))
        end = time.perf_counter()
        if sync >= 2:
            send.append((sent - start) * 1e3)
            receive.append((end - middle) * 1e3)
    return (statistics.median(send), min(send)), (statistics.median(receive), min(receive))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensors", type=int, default=290)
    p.add_argument("--numel", type=int, default=256, help="bf16 elements per tensor")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--label", default="")
    p.add_argument("--delta", action="store_true", help="time a delta's header instead")
    a = p.parse_args()
    if a.delta:
        send, receive = delta_header(a.tensors, a.reps)
        print(f"| delta header host {a.label} | {a.tensors} entries | sender {send[0]:.2f} ms "
              f"(least {send[1]:.2f}) | receiver {receive[0]:.2f} ms (least {receive[1]:.2f}) | "
              f"total {send[0] + receive[0]:.2f} ms (least {send[1] + receive[1]:.2f}) |")
        return
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
