"""``tensor_set``: what the encoders keep of a set of tensors across syncs, rebuilt when a
tensor is replaced, resized, re-typed or made non-contiguous; and the full payload and
delta header built from it give the bytes of a fresh build."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_mode import DEVICE, kernels, needs_triton

from dte_codec import body_digest, decode, encode_full
from dte_codec.dispatch import reference
from dte_codec.encode import FullLayout, full_layout
from dte_codec.encodings import IndexEncoding, Kind, ValueEncoding
from dte_codec.entry import Entry
from dte_codec.entry_pack import FIELDS, EntryTemplates
from dte_codec.header import NO_BASE
from dte_codec.parts import assemble, dense_part
from dte_codec.table_bytes import pack_entries
from dte_codec.tensor_set import tensor_set


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"a": torch.randn(6, 5, generator=gen).bfloat16(),
            "b": torch.randn(7, generator=gen),
            "c": torch.randint(0, 9, (3, 3), generator=gen, dtype=torch.int32)}


def _fresh_full(weights: dict[str, torch.Tensor], version: int) -> bytes:
    """A full payload built without any kept layout."""
    parts = [dense_part(name, t) for name, t in weights.items()]
    return bytes(assemble(parts, stream_id="s", kind=Kind.FULL, base_version=NO_BASE,
                          version=version))


def test_unchanged_set_is_kept():
    """The same tensors, written in place, give the same kept facts."""
    weights = _weights()
    first = tensor_set(weights)
    weights["a"].add_(1)
    assert first is tensor_set(weights)
    assert first is tensor_set(dict(weights))


@pytest.mark.parametrize("change", ["replace", "resize", "retype", "transpose", "device"])
def test_changed_tensor_rebuilds_the_set(change):
    """A tensor replaced by another storage, resized in place, of another dtype under the
    same storage, made non-contiguous, or the set spread over devices: new facts."""
    weights = _weights()
    first = tensor_set(weights)
    if change == "replace":
        weights["b"] = weights["b"].clone()
    elif change == "resize":
        weights["b"].resize_(3)
    elif change == "retype":
        weights["b"] = weights["b"].view(torch.int32)
    elif change == "transpose":
        weights["c"] = weights["c"].t()
    else:
        weights["b"] = weights["b"].to("meta")
    second = tensor_set(weights)
    assert first is not second
    assert [tuple(t.shape) for t in weights.values()] == [tuple(s) for s in second.table.shapes]
    expected_pointers = [t.data_ptr() for t in weights.values()]
    assert expected_pointers == second.pointer.tolist()


def test_full_payload_follows_in_place_writes():
    """A kept full layout reads the tensors' bytes of each sync: written in place, the
    payload is the one a fresh build gives."""
    weights = _weights()
    encode_full(weights, stream_id="s", version=1)
    weights["a"].view(torch.int16).view(-1)[::3] += 1
    weights["b"][2] = float("nan")
    assert _fresh_full(weights, 2) == bytes(encode_full(weights, stream_id="s", version=2))


@pytest.mark.parametrize("change", ["replace", "resize"])
def test_full_payload_after_a_tensor_changed(change):
    """A replaced or resized tensor: the next full payload carries it as it is now."""
    weights = _weights()
    encode_full(weights, stream_id="s", version=1)
    if change == "replace":
        weights["b"] = torch.arange(7, dtype=torch.float32)
    else:
        weights["a"].resize_(2, 3).fill_(1.5)
    payload = encode_full(weights, stream_id="s", version=2)
    assert _fresh_full(weights, 2) == bytes(payload)
    decoded = decode(payload)
    assert [tuple(t.shape) for t in weights.values()] == [e.shape for e in decoded.header.entries]


def test_full_layout_kept_only_for_views():
    """A non-contiguous tensor is copied, so its set's layout is built anew each time."""
    weights = _weights()
    assert full_layout(weights) is full_layout(weights)
    weights["c"] = weights["c"].t()
    assert full_layout(weights) is not full_layout(weights)
    assert isinstance(full_layout(weights), FullLayout)
    weights["c"][0, 1] = 77
    assert _fresh_full(weights, 3) == bytes(encode_full(weights, stream_id="s", version=3))


def test_odd_sized_tensor_digest_sees_new_bytes():
    """A tensor whose last word is put together with the padding (a copy) is hashed
    afresh each sync: a change in that word changes the payload's digest as a fresh
    build's does."""
    weights = {"odd": torch.arange(5, dtype=torch.uint8), "w": torch.ones(4)}
    encode_full(weights, stream_id="s", version=1)
    weights["odd"][4] = 9
    assert _fresh_full(weights, 2) == bytes(encode_full(weights, stream_id="s", version=2))


def test_entry_templates_pack_what_the_header_packs():
    """Templates filled with each entry's fields give ``Header.pack``'s entry bytes, for
    any subset of the tensors in order."""
    names = ["w", "layers.0.ß", "x" * 300, "v"]
    dtypes = [torch.bfloat16, torch.float32, torch.int8, torch.float16]
    shapes = [(4, 5), (7,), (2, 3, 4), ()]
    templates = EntryTemplates(names, dtypes, shapes)
    entries = [Entry(name="w", dtype=torch.bfloat16, shape=(4, 5), count=3,
                     index_encoding=IndexEncoding.GAP8, index_escapes=1,
                     value_encoding=ValueEncoding.RESIDUE, value_width=3, value_escapes=2),
               Entry(name="x" * 300, dtype=torch.int8, shape=(2, 3, 4), count=24),
               Entry(name="v", dtype=torch.float16, shape=(), count=1,
                     index_encoding=IndexEncoding.ELIAS_FANO, index_width=62)]
    fields = np.zeros(len(entries), FIELDS)
    for name in FIELDS.names:
        if name != "reserved":
            fields[name] = [int(getattr(e, name)) for e in entries]
    assert pack_entries(tuple(entries)) == templates.pack(np.array([0, 2, 3]), fields)
    assert b"" == templates.pack(np.array([], np.int64), fields[:0])


@needs_triton
def test_kept_full_layout_follows_the_reference_switch(monkeypatch):
    """A layout kept from a sync on the digest kernel hashes with the torch reference
    inside ``dispatch.reference()``, to the same payload."""
    weights = {name: t.to(DEVICE) for name, t in _weights().items()}
    with kernels():
        first = bytes(encode_full(weights, stream_id="s", version=1))
    calls = []
    torch_digest = body_digest.runs_digest_torch
    monkeypatch.setattr(body_digest, "runs_digest_torch",
                        lambda runs: calls.append(len(runs)) or torch_digest(runs))
    with kernels(), reference():
        second = bytes(encode_full(weights, stream_id="s", version=1))
    assert first == second
    assert [len(full_layout(weights).runs.runs)] == calls
