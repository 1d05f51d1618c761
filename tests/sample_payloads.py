"""The payloads the fuzz and rollback tests start from: version-1 weights of several
dtypes (a 0-d and an empty tensor among them), their full payload, and a delta to version 2
that uses every index encoding but the raw ones and every value encoding."""

from __future__ import annotations

import attrs
import torch
from dte_codec import encode_delta, encode_full
from dte_detector import ChangeSet, diff
from dte_detector.changes import unknown_bounds
from dte_transport import Receiver

STREAM = "fuzz-stream"


def weights() -> dict[str, torch.Tensor]:
    """The receiver's tensors at version 1: several dtypes, a 0-d and an empty tensor."""
    gen = torch.Generator().manual_seed(1234)
    return {
        "embed": torch.randn(64, 48, generator=gen).to(torch.bfloat16),
        "proj": torch.randn(40, 33, generator=gen).to(torch.float16),
        "norm": torch.randn(33, generator=gen),
        "bias": torch.randn(7, generator=gen),
        "grid": torch.randn(6000, generator=gen).to(torch.bfloat16),
        "scale": torch.tensor(0.5, dtype=torch.bfloat16),
        "empty": torch.empty(0, 4),
    }


def step(weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    """Version 2 and its change sets: sparse +-1 ulp (Elias-Fano), 40 % (bitmap), evenly
    spaced (GAP8), dense, raw escapes and unknown bounds."""
    gen = torch.Generator().manual_seed(99)
    new = {name: t.clone() for name, t in weights.items()}

    def bump(name: str, rate: float, ulps: int = 1) -> None:
        flat = new[name].view(-1)
        ints = flat.view({2: torch.int16, 4: torch.int32}[flat.element_size()])
        picked = torch.rand(flat.numel(), generator=gen) < rate
        ints[picked] += torch.randint(-ulps, ulps + 1, (int(picked.sum()),), generator=gen,
                                      dtype=ints.dtype)

    bump("embed", 0.04)
    new["embed"].view(-1)[[5, 900, 3000]] = torch.tensor([float("nan"), 1e4, -0.0],
                                                           dtype=torch.bfloat16)
    bump("proj", 0.5, ulps=2)
    new["norm"] += 1.0
    new["grid"][100::190] *= 2
    new["scale"].fill_(0.75)
    changes = {name: diff(weights[name], new[name]) for name in weights}
    bias_idx = torch.tensor([2], dtype=torch.int32)
    new["bias"][2] = -7.0
    low, high = unknown_bounds(torch.float32, 1, torch.device("cpu"))
    changes["bias"] = ChangeSet(bias_idx, low, high)
    return new, changes


@attrs.frozen
class Sample:
    weights: dict[str, torch.Tensor]
    full: bytes
    delta: bytes


def build_sample() -> Sample:
    """Version-1 weights with their full payload and the delta to version 2."""
    weights_v1 = weights()
    new, changes = step(weights_v1)
    full = encode_full(weights_v1, stream_id=STREAM, version=1)
    delta = encode_delta(new, changes, stream_id=STREAM, base_version=1, version=2)
    return Sample(weights_v1, bytes(full), bytes(delta))  # fuzzed as the bytes of files and links


def fresh_receiver(setup: Sample) -> Receiver:
    """A receiver that has accepted the full payload: at version 1 of ``STREAM``."""
    receiver = Receiver({name: torch.empty_like(t) for name, t in setup.weights.items()})
    assert receiver.receive(setup.full).accepted
    return receiver


def snapshot(receiver: Receiver) -> dict[str, torch.Tensor]:
    """A copy of the receiver's tensors, to compare against after a rejection."""
    return {name: t.clone() for name, t in receiver.weights.items()}
