"""The fused encoder sends the new values a change set carries (``values``, as
``dte_detector.ChangeSet.values``) instead of reading the tensors.

Values that are the tensors' own at the indices (their contract) give the reference's
bytes. Values that differ from the tensors show which the kernels send: the change
sets', decoded at every sparse entry (a dense entry copies the tensor, as the reference
does), so a ``_stats`` that read the tensors would fail here. On a CUDA device the
kernels run there, on the CPU under Triton's interpreter (``kernel_mode``).
"""

from __future__ import annotations

import torch
from codec_cases import (INT_VIEWS, Change, Valued, assert_encoders_agree, named, nearby,
                         patterns, tensor_and_change)
from hypothesis import example, given, settings
from hypothesis import strategies as st
from kernel_mode import CUDA, DEVICE, kernels, needs_triton

from dte_codec import apply_
from dte_codec.decode import decode_per_entry
from dte_codec.encode import encode_delta_per_tensor
from dte_codec.encodings import IndexEncoding
from dte_codec.flat_encode import encode_delta_flat
from dte_codec.header import Header

pytestmark = needs_triton
EXAMPLES = settings(max_examples=40 if CUDA else 6, deadline=None)
"""The interpreter runs a kernel as numpy per program: fewer examples on the CPU."""
CASE = tensor_and_change(largest=70**3 if CUDA else 5000)
VERSIONS = {"stream_id": "s", "base_version": 4, "version": 5}


def _blocks() -> list:
    """Sparse changes over many kernel blocks (256 elements) in tensors of every item
    size (2, 4, 8 and 1 bytes)."""
    gen = torch.Generator().manual_seed(5)
    cases = []
    for dtype, numel, step in ((torch.bfloat16, 50000, 20), (torch.float32, 3000, 2),
                               (torch.float64, 2000, 3), (torch.uint8, 4000, 5)):
        tensor = patterns(gen, dtype, numel)
        at = torch.arange(0, numel, step)
        base = nearby(gen, tensor[at], 3)
        cases.append((tensor, Change(at, base, base)))
    return cases


def _valued(cases, seed: int | None = None) -> list:
    """The cases with change sets that carry new values: the tensors' own at the
    indices, or, with ``seed``, arbitrary bit patterns."""
    gen = torch.Generator().manual_seed(seed or 0)
    valued = []
    for tensor, change in cases:
        own = tensor.reshape(-1)[change.indices.long()]
        values = own if seed is None else patterns(gen, tensor.dtype, own.numel())
        valued.append((tensor, Valued(change.indices, change.base_low, change.base_high,
                                      values)))
    return valued


def _holding_values(tensors: dict, changes: dict) -> dict:
    """``tensors`` with each change set's values written at its indices."""
    held = {name: tensor.clone(memory_format=torch.contiguous_format)
            for name, tensor in tensors.items()}
    for name, change in changes.items():
        held[name].reshape(-1)[change.indices.long()] = change.values
    return held


def _bits(tensor: torch.Tensor) -> list[int]:
    return tensor.cpu().reshape(-1).view(INT_VIEWS[tensor.element_size()]).tolist()


@EXAMPLES
@given(st.lists(CASE, max_size=6))
@example(_blocks())
def test_kernel_encoder_given_the_tensors_values_writes_the_reference_bytes(cases):
    """Change sets that carry the tensors' own values at their indices: byte-identical
    payloads to the reference's, which reads the tensors."""
    with kernels():
        assert_encoders_agree(_valued(cases), DEVICE)


@EXAMPLES
@given(st.lists(CASE, max_size=6), st.integers(0, 2**31 - 1))
@example(_blocks(), 1)
def test_kernel_encoder_sends_the_change_sets_values(cases, seed):
    """Values other than the tensors' at the indices: the receiver, from bases inside
    the bounds, ends with the change sets' values at every sparse entry and with the
    tensor at every dense one (both hold the tensors' values elsewhere)."""
    valued = _valued(cases, seed)
    tensors, changes = named(valued)
    with kernels():
        frame = encode_delta_flat(*named(valued, DEVICE), **VERSIONS)
    payload = decode_per_entry(bytes(frame))
    received = {}
    for name, tensor in tensors.items():
        received[name] = tensor.clone()
        received[name].reshape(-1)[changes[name].indices.long()] = changes[name].base_low
    apply_(received, payload)
    held = _holding_values(tensors, changes)
    sparse = {entry.name for entry, where in zip(payload.header.entries, payload.indices)
              if isinstance(where, torch.Tensor)}
    for name, tensor in tensors.items():
        assert _bits(held[name] if name in sparse else tensor) == _bits(received[name])


def test_kernel_encoder_writes_the_reference_bytes_of_the_values():
    """Sparse entries over many blocks, values other than the tensors': the bytes the
    reference writes for tensors holding those values (and not those it writes for the
    tensors themselves)."""
    cases = _valued(_blocks(), seed=2)
    tensors, changes = named(cases)
    with kernels():
        actual = bytes(encode_delta_flat(*named(cases, DEVICE), **VERSIONS))
    expected = bytes(encode_delta_per_tensor(_holding_values(tensors, changes), changes,
                                             **VERSIONS))
    entries = Header.unpack(memoryview(expected))[0].entries
    assert IndexEncoding.DENSE not in [entry.index_encoding for entry in entries]
    assert expected == actual
    assert bytes(encode_delta_per_tensor(tensors, changes, **VERSIONS)) != actual
