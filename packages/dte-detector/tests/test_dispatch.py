"""Which path runs: the torch reference on CPU and when forced, the kernels otherwise."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from detector_cases import bits_of

from dte_detector import CastDetector, dispatch

_CUDA_LIKE = SimpleNamespace(is_cuda=True)


def test_cpu_tensors_take_the_reference():
    """A CPU tensor never reaches the kernels (triton need not be installed)."""
    assert not dispatch.kernels_for(torch.zeros(1), payload=torch.bfloat16)


def test_kernels_need_cuda_a_16_bit_payload_and_triton(monkeypatch):
    """CUDA tensors with a bf16 or fp16 payload take the kernels when triton imports;
    fp32 payloads and a missing triton take the reference."""
    monkeypatch.setattr(dispatch, "_triton_installed", lambda: True)
    assert dispatch.kernels_for(_CUDA_LIKE, payload=torch.bfloat16)
    assert dispatch.kernels_for(_CUDA_LIKE, payload=torch.float16)
    assert not dispatch.kernels_for(_CUDA_LIKE, payload=torch.float32)
    monkeypatch.setattr(dispatch, "_triton_installed", lambda: False)
    assert not dispatch.kernels_for(_CUDA_LIKE, payload=torch.bfloat16)


def test_reference_forces_the_torch_path_until_the_block_ends(monkeypatch):
    """Inside ``reference()`` (nested too) nothing takes the kernels; after it, and after
    an exception in it, the kernels are back."""
    monkeypatch.setattr(dispatch, "_triton_installed", lambda: True)
    with pytest.raises(RuntimeError, match="inside"):
        with dispatch.reference():
            with dispatch.reference():
                assert not dispatch.kernels_for(_CUDA_LIKE, payload=torch.bfloat16)
            assert not dispatch.kernels_for(_CUDA_LIKE, payload=torch.bfloat16)
            raise RuntimeError("inside")
    assert dispatch.kernels_for(_CUDA_LIKE, payload=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_record_and_copy_is_record_then_copy(dtype):
    """On CPU ``record_and_copy`` records the flips, then copies the cast master."""
    master = torch.tensor([1.0 + 2**-10, 2.03125, 0.0, -0.0, float("nan"), 3.0])
    model = torch.tensor([1.0, 2.0, -0.0, -0.0, 5.0, 3.0], dtype=dtype)
    old = model.clone()
    detector = CastDetector()
    detector.record_and_copy("w", master, model)
    assert bits_of(master.to(dtype)) == bits_of(model)
    changes = detector.changes("w", model)
    flipped = [i for i, (a, b) in enumerate(zip(bits_of(old), bits_of(model))) if a != b]
    assert flipped == changes.indices.tolist()
    assert bits_of(old[flipped]) == bits_of(changes.base_low)
