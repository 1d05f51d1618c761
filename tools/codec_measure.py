"""How ``bench_codec.py`` measures one step: a loopback link and a sender that keep what they
sent last, the bitwise exactness checks, the bytes of ours and of every peer method, and
the timing of our encode and decode+apply against the dense path."""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Mapping

import torch
import zstandard
from areal_dte import TorchActor
from dte_codec import Frame, Header, apply_, decode, encode_delta, encode_full
from dte_detector import diff
from dte_transport import Loopback, Sender


# --- the product path, recorded; exactness checks ---------------------------------------

class RecordingLoopback(Loopback):
    """A loopback link that keeps the last payload's bytes."""

    def send(self, frame: Frame):
        self.last = bytes(frame)
        return super().send(frame)


class RecordingSender(Sender):
    """A sender that keeps the change sets it encoded last."""

    def sync(self, weights, *, changes, **kwargs):
        def recorded():
            self.last_changes = changes()
            return self.last_changes
        return super().sync(weights, changes=recorded, **kwargs)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int16)


def clone(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in weights.items()}


def assert_same(expected: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor],
                what: str) -> None:
    for name, tensor in expected.items():
        if not torch.equal(bits(tensor), bits(got[name])):
            bad = int((bits(tensor) != bits(got[name])).sum())
            raise AssertionError(f"{what}: tensor {name!r} differs in {bad} elements")


# --- what each method costs -----------------------------------------------------------

def peer_sizes(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor],
               truth: Mapping, ours: bytes, level: int) -> dict[str, int]:
    """Bytes of each peer method for one step, one zstd frame per method."""
    # one compressor per stream: a ZstdCompressor's context serves one compressobj at a time
    packed, xor, gapped = (zstandard.ZstdCompressor(level=level).compressobj() for _ in range(3))
    sizes = Counter()
    for name, tensor in new.items():
        o, n = bits(old[name]).cpu(), bits(tensor).cpu()
        sizes["slime_xor_zstd"] += len(xor.compress((o ^ n).numpy().tobytes()))
        idx = truth[name].indices.to(torch.int64).cpu()
        if idx.numel() == 0:
            continue
        pair = idx.to(torch.int32).numpy().tobytes() + n[idx].numpy().tobytes()
        sizes["int32_bf16"] += len(pair)
        sizes["int32_bf16_zstd"] += len(packed.compress(pair))
        gaps = torch.diff(idx, prepend=idx.new_zeros(1)).to(torch.int32)
        delta = (n[idx].to(torch.int32) - o[idx].to(torch.int32)).to(torch.int16)  # wraps
        sizes["gap_delta_zstd"] += len(gapped.compress(gaps.numpy().tobytes()
                                                       + delta.numpy().tobytes()))
    for key, stream in (("slime_xor_zstd", xor), ("int32_bf16_zstd", packed),
                        ("gap_delta_zstd", gapped)):
        sizes[key] += len(stream.flush())
    sizes["ours_zstd"] = len(zstandard.ZstdCompressor(level=level).compress(ours))
    return dict(sizes)


def breakdown(data: bytes) -> Counter:
    """Bytes of a payload by part: header, index and value sections by encoding, padding."""
    header, body_offset = Header.unpack(memoryview(data))
    parts = Counter(header=body_offset, entries=len(header.entries))
    for e in header.entries:
        values = e.value_sections()
        parts[f"index {e.index_encoding.name}"] += sum(e.index_sections())
        if len(values) == 3:  # residue: fields, escape positions, escaped raw values
            parts[f"values RESIDUE w={e.value_width}"] += values[0]
            parts["value escapes (raw)"] += values[1] + values[2]
        else:
            parts[f"values {e.value_encoding.name}"] += values[0]
        parts["padding"] += sum(-s % 8 for s in e.section_sizes())
    return parts


def _binary_entropy(p: float) -> float:
    return 0.0 if p in (0.0, 1.0) else -p * math.log2(p) - (1 - p) * math.log2(1 - p)


def measure_step(actor: TorchActor, sender: RecordingSender, link: RecordingLoopback,
                 prev: Mapping[str, torch.Tensor], version: int, a) -> dict:
    """Bytes of every method for the step just synced, with exactness checks."""
    model = actor.model
    truth = {n: diff(prev[n], t) for n, t in model.items()}
    changed = sum(len(c) for c in truth.values())
    # The receiver already equals the model bit for bit, so no true change was left out of
    # the adamw change set: it is a superset of ``truth`` and ``reported - changed`` extra.
    reported = sum(len(c) for c in sender.last_changes.values())
    position_bits, deltas = 0.0, []
    for name, change in truth.items():
        true = change.indices.to(torch.int64)
        deltas.append(bits(model[name])[true].to(torch.int32)
                      - bits(prev[name])[true].to(torch.int32))
        position_bits += model[name].numel() * _binary_entropy(true.numel() / model[name].numel())
    snap = encode_delta(model, truth, stream_id="bench-snapshot", base_version=version - 1,
                        version=version)
    weights = clone(prev)
    apply_(weights, decode(snap, device=a.device))
    assert_same(model, weights, "snapshot delta applied onto the previous weights")
    sizes = peer_sizes(prev, model, truth, link.last, a.zstd_level)
    sizes.update(adamw=len(link.last), snapshot=snap.nbytes)
    deltas = torch.cat(deltas)
    counts = torch.unique(deltas, return_counts=True)[1].double()
    value_bits = float(-(counts * (counts / changed).log2()).sum())
    return {"changed": changed, "reported": reported, "sizes": sizes,
            "one_ulp": int((deltas.abs() == 1).sum()), "parts": breakdown(link.last),
            "h0_positions": position_bits / 8, "h0": (position_bits + value_bits) / 8}


# --- timing ---------------------------------------------------------------------------

def _timed(fn: Callable[[object], object], setup: Callable[[], object], a) -> tuple[float, float]:
    """Median and p90 in ms of ``fn(setup())`` over ``a.reps`` runs after warm-up."""
    cuda = a.device.startswith("cuda")
    samples = []
    for i in range(a.timing_warmup + a.reps):
        arg = setup()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(arg)
        if cuda:
            torch.cuda.synchronize()
        if i >= a.timing_warmup:
            samples.append((time.perf_counter() - start) * 1e3)
    samples.sort()
    return statistics.median(samples), samples[math.ceil(0.9 * len(samples)) - 1]


def time_codec(model, changes, prev, *, stream: str, version: int, a) -> dict[str, tuple]:
    """Our encode and decode+apply against the dense path, on one step."""
    def delta(_=None):
        return encode_delta(model, changes, stream_id=stream, base_version=version - 1,
                            version=version)

    def full(_=None):
        return encode_full(model, stream_id=stream, version=version)

    delta_frame, full_frame = delta(), full()
    return {
        "encode": _timed(delta, lambda: None, a),
        "encode dense": _timed(full, lambda: None, a),
        "decode+apply": _timed(lambda w: apply_(w, decode(delta_frame, device=a.device)),
                               lambda: clone(prev), a),
        "decode+apply dense": _timed(lambda w: apply_(w, decode(full_frame, device=a.device)),
                                     lambda: clone(prev), a),
    }
