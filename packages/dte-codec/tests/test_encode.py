"""Building payloads: what goes in, which entries come out, and what the sender gets wrong."""

from __future__ import annotations

import pytest
import torch
from dte_codec import Kind, decode, encode_delta, encode_full
from dte_codec.encodings import IndexEncoding, ValueEncoding
from dte_codec.errors import EncodeError
from dte_codec.header import NO_BASE
from dte_detector import ChangeSet, diff


def _weights() -> dict[str, torch.Tensor]:
    return {"a": torch.arange(8, dtype=torch.float32),
            "b": torch.linspace(-1, 1, 300).to(torch.bfloat16)}


def _changes(weights, **overrides) -> dict[str, ChangeSet]:
    changes = {name: ChangeSet.empty(t) for name, t in weights.items()}
    changes.update(overrides)
    return changes


def _delta(weights, changes, *, base_version=1, version=2) -> bytes:
    return encode_delta(weights, changes, stream_id="s", base_version=base_version,
                        version=version)


def _encode_error(call) -> str:
    with pytest.raises(EncodeError) as info:
        call()
    assert isinstance(info.value, ValueError)
    return str(info.value)


def test_full_carries_every_tensor_dense():
    """A full payload has one dense raw entry per tensor, in mapping order, and no base."""
    weights = _weights()
    header = decode(encode_full(weights, stream_id="s", version=7)).header
    assert (Kind.FULL, NO_BASE, 7, "s") == (header.kind, header.base_version,
                                            header.payload_version, header.stream_id)
    assert [("a", 8, IndexEncoding.DENSE, ValueEncoding.RAW),
            ("b", 300, IndexEncoding.DENSE, ValueEncoding.RAW)] == [
        (e.name, e.count, e.index_encoding, e.value_encoding) for e in header.entries]


def test_full_of_nothing():
    """An empty mapping makes a valid full payload without entries or body."""
    payload = decode(encode_full({}, stream_id="", version=0))
    assert ((), 0) == (payload.header.entries, payload.nbytes)


def test_full_of_non_contiguous_tensor():
    """A non-contiguous tensor travels in its logical (row-major) order."""
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    payload = decode(encode_full({"t": tensor}, stream_id="s", version=1))
    assert tensor.reshape(-1).tolist() == payload.values[0][0].view(torch.float32).tolist()


def test_delta_leaves_unchanged_tensors_out():
    """Tensors with an empty change set have no entry."""
    weights = _weights()
    new = dict(weights, a=weights["a"].clone())
    new["a"][3] = 30.0
    header = decode(_delta(new, _changes(weights, a=diff(weights["a"], new["a"])))).header
    assert ["a"] == [e.name for e in header.entries]


def test_delta_of_nothing():
    """A delta where nothing changed is valid and empty."""
    weights = _weights()
    header = decode(_delta(weights, _changes(weights))).header
    assert (Kind.DELTA, ()) == (header.kind, header.entries)


def test_delta_goes_dense_when_cheaper():
    """A tensor whose sparse form would not be smaller than its bytes is sent dense."""
    weights = _weights()
    new = dict(weights, a=-weights["a"] - 1e30)  # sign flips: no residue fits
    entry = decode(_delta(new, _changes(weights, a=diff(weights["a"], new["a"])))
                   ).header.entries[0]
    assert (IndexEncoding.DENSE, 8) == (entry.index_encoding, entry.count)


def test_delta_is_deterministic():
    """The same inputs give the same bytes."""
    weights = _weights()
    new = dict(weights, b=weights["b"].clone())
    new["b"][::7] *= 2
    changes = _changes(weights, b=diff(weights["b"], new["b"]))
    assert bytes(_delta(new, changes)) == bytes(_delta(new, changes))


def test_missing_change_set():
    """Every tensor needs a change set."""
    weights = _weights()
    changes = _changes(weights)
    del changes["b"]
    assert ("changes: expected one change set per tensor, got missing ['b'], extra []"
            == _encode_error(lambda: _delta(weights, changes)))


def test_extra_change_set():
    """A change set without a tensor is an error too."""
    weights = _weights()
    changes = _changes(weights, c=ChangeSet.empty(weights["a"]))
    assert ("changes: expected one change set per tensor, got missing [], extra ['c']"
            == _encode_error(lambda: _delta(weights, changes)))


@pytest.mark.parametrize(("indices", "message"), [
    ([3, 1], "indices: expected strictly increasing, got 1 after 3 at 1"),
    ([2, 2], "indices: expected strictly increasing, got 2 after 2 at 1"),
    ([0, 8], "indices: expected inside [0, 8), got [0, 8]"),
    ([-1, 4], "indices: expected inside [0, 8), got [-1, 4]"),
])
def test_bad_indices(indices, message):
    """Indices must be sorted, unique and inside the tensor."""
    weights = _weights()
    index = torch.tensor(indices, dtype=torch.int32)
    change = ChangeSet.exact(index, torch.zeros(len(indices)))
    assert f"tensor 'a': {message}" == _encode_error(
        lambda: _delta(weights, _changes(weights, a=change)))


@pytest.mark.parametrize(("low", "high", "message"), [
    (torch.zeros(2, dtype=torch.float16), torch.zeros(2),
     "base_low: expected torch.float32 of shape (2,), got torch.float16 of shape (2,)"),
    (torch.zeros(2), torch.zeros(3),
     "base_high: expected torch.float32 of shape (2,), got torch.float32 of shape (3,)"),
    (torch.zeros(2), torch.zeros(1, 2),
     "base_high: expected torch.float32 of shape (2,), got torch.float32 of shape (1, 2)"),
])
def test_bad_bounds(low, high, message):
    """Bounds must have the tensor's dtype and one value per index."""
    weights = _weights()
    change = ChangeSet(torch.tensor([1, 2]), low, high)
    assert f"tensor 'a': {message}" == _encode_error(
        lambda: _delta(weights, _changes(weights, a=change)))


@pytest.mark.parametrize(("base_version", "version", "message"), [
    (2, 2, "base_version: expected 0..1 for a delta, got 2"),
    (3, 2, "base_version: expected 0..1 for a delta, got 3"),
    (-1, 2, "base_version: expected 0..1 for a delta, got -1"),
    (0, -1, "payload_version: expected 0..2**63-1, got -1"),
    (0, 2**63, "payload_version: expected 0..2**63-1, got 9223372036854775808"),
    (0, 1.5, "payload_version: expected 0..2**63-1, got 1.5"),
])
def test_bad_delta_versions(base_version, version, message):
    """A delta goes from an older, non-negative version to a newer one that fits int64."""
    weights = _weights()
    assert message == _encode_error(
        lambda: _delta(weights, _changes(weights), base_version=base_version, version=version))


@pytest.mark.parametrize(("version", "message"), [
    (-1, "payload_version: expected 0..2**63-1, got -1"),
    (2**63, "payload_version: expected 0..2**63-1, got 9223372036854775808"),
    (1.5, "payload_version: expected 0..2**63-1, got 1.5"),
])
def test_bad_full_version(version, message):
    """Regression: a float version raised ``struct.error``; every bad version is an
    ``EncodeError`` naming the field."""
    assert message == _encode_error(
        lambda: encode_full(_weights(), stream_id="s", version=version))


def test_stream_id_too_long():
    """Regression: a stream id over 65,535 UTF-8 bytes raised ``struct.error``."""
    assert "stream_id: expected <= 65535 UTF-8 bytes, got 65536" == _encode_error(
        lambda: encode_full(_weights(), stream_id="x" * 65536, version=1))


def test_name_too_long():
    """Names over 65,535 UTF-8 bytes are rejected, the message quoting their start."""
    name = "é" * 40000
    assert f"tensor {name[:64]!r}: name: expected <= 65535 UTF-8 bytes, got 80000" == (
        _encode_error(lambda: encode_full({name: torch.zeros(1)}, stream_id="s", version=1)))


def test_unsupported_dtype():
    """Only the dtypes of the format's dtype table can travel."""
    assert ("tensor 'c': dtype: expected one of [torch.bfloat16, torch.float16, "
            "torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16, torch.int32, "
            "torch.int64, torch.bool], got torch.complex64") == _encode_error(
        lambda: encode_full({"c": torch.zeros(2, dtype=torch.complex64)}, stream_id="s",
                            version=1))


def test_encode_error_carries_fields():
    """``EncodeError`` keeps ``field``, ``expected``, ``got`` and ``tensor``."""
    weights = _weights()
    with pytest.raises(EncodeError) as info:
        _delta(weights, _changes(weights), base_version=5, version=2)
    assert ("base_version", "0..1 for a delta", 5, None) == (
        info.value.field, info.value.expected, info.value.got, info.value.tensor)
