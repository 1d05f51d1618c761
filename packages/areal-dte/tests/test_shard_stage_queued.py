"""ShardStage's routed deltas whose decode left the body's checks queued
(``decode_queued``, as on a GPU): read once with the routes' summary, and a delta whose
checks fail refused as the reference refuses it, before anything is written.

On a CUDA device the kernels run there; on the CPU under Triton's interpreter
(``kernel_mode``).
"""

from __future__ import annotations

import contextlib
import sys

import numpy as np
import pytest
from kernel_mode import DEVICE, kernels, needs_triton
from bitwise import first_difference
from dte_codec import decode
from dte_codec.decode import QueuedChecks, decode_queued
from dte_codec.encodings import IndexEncoding, ValueEncoding, index_itemsizes
from dte_codec.flat_decode import INDEX_SECTIONS
from forge import redigest
from dte_codec.sglang_layout import sglang_shard
from dte_transport import Rejection
from shard_stage_cases import (CASES, canonical_weights, delta_frame, on_cpu, receiver_pair,
                               source_shard, stepped)

pytestmark = needs_triton


@contextlib.contextmanager
def _queued():
    """Inside: the kernels run and the decode batches on ``DEVICE`` (as on a GPU: the
    body's checks stay queued, ``decode_queued``)."""
    with kernels(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys.modules["dte_codec.decode"], "batched", lambda device: True)
        yield


def _queued_pair(monkeypatch):
    """A reference receiver and a routed one, a delta for them, and a log of the values
    ``QueuedChecks.settle`` is given when it compares them (None: it read them itself)."""
    settled = []
    original = QueuedChecks.settle

    def settle(self, values=None):
        if not self.read:
            settled.append(values)
        return original(self, values)

    monkeypatch.setattr(QueuedChecks, "settle", settle)
    config, layout, kind = CASES[3]
    source = source_shard(config, kind)
    old = canonical_weights(config, 0)
    data = delta_frame(source, old, stepped(old, 1, 0.1))
    reference, routed = receiver_pair(source, sglang_shard(config, layout, rank=1), old)
    return reference, routed, data, settled


def test_queued_decode_checks_are_read_with_the_routes(monkeypatch):
    """A delta whose decode left its checks queued is routed with one read of both: the
    routes' summary carries the digest and the failed-check count, which settle there,
    and the rank ends bit for bit as the reference's."""
    reference, routed, data, settled = _queued_pair(monkeypatch)
    with _queued():
        assert decode_queued(data, device=DEVICE).checks is not None
        settled.clear()
        assert routed.receive(data).accepted
    assert reference.receive(data).accepted
    assert 1 == len(settled)
    assert settled[0] is not None
    assert first_difference(reference.weights, on_cpu(routed.weights)) is None


def _forged(data: bytes, how: str) -> bytes:
    """``data`` with one check of its body made to fail, its digests recomputed: the set
    bits of an Elias-Fano upper stream or bitmap miscounted (``indices``), or a residue
    escape position past its entry (``positions``)."""
    header = decode(data).header
    c, sections = header.columns(), header.sections()
    body = len(data) - header.body_size()
    out = bytearray(data)
    enc = c["index_encoding"]
    if how == "indices":
        entry = int(np.flatnonzero(np.isin(enc, [IndexEncoding.ELIAS_FANO,
                                                 IndexEncoding.BITMAP]))[0])
        at = body + int(sections.offsets[sections.firsts[entry]
                                         + (enc[entry] == IndexEncoding.ELIAS_FANO)])
        out[at] = 0 if out[at] == 0xFF else 0xFF  # another set-bit count
    else:
        entry = int(np.flatnonzero((c["value_encoding"] == ValueEncoding.RESIDUE)
                                   & (c["value_escapes"] > 0))[0])
        at = body + int(sections.offsets[sections.firsts[entry] + INDEX_SECTIONS[enc[entry]]
                                         + 1])
        out[at:at + int(index_itemsizes(c["count"][entry:entry + 1])[0])] = b"\xff" * 8
    return redigest(out)


@pytest.mark.parametrize("how", ["body", "indices", "positions", "wrong-base"])
def test_queued_decode_refuses_a_bad_delta_as_the_reference(monkeypatch, how):
    """A delta whose queued checks fail is refused with the reference's rejection and
    error, before anything is written: a changed body byte (body digest), a miscounted
    index stream or an escape position out of range (digests recomputed: the entry's
    error), and a corrupted delta onto the wrong base (the bad payload is named, not the
    base)."""
    reference, routed, data, _ = _queued_pair(monkeypatch)
    data = bytes(data)
    if how in ("body", "wrong-base"):
        bad = bytearray(data)
        bad[-9] ^= 0x01
        bad = bytes(bad)
        if how == "wrong-base":
            reference.version = routed.version = 7
    else:
        bad = _forged(data, how)
    before = on_cpu(routed.weights)
    expected = reference.receive(bad)
    with _queued():
        got = routed.receive(bad)
    assert (False, Rejection.BAD_PAYLOAD) == (expected.accepted, expected.rejection)
    assert ("body_digest" in expected.detail) == (how in ("body", "wrong-base"))
    assert (expected.accepted, expected.rejection, expected.detail, expected.version) == (
        got.accepted, got.rejection, got.detail, got.version)
    assert first_difference(before, on_cpu(routed.weights)) is None
