"""Staged-file store under a killed writer and a reader racing the writer."""

import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from dte_codec import encode_delta, encode_full
from dte_detector import diff
from dte_transport import Receiver, Sender, StagedLink, StagedReader

pytestmark = pytest.mark.processes

STREAM = "stream-a"
BITS = {2: torch.int16, 4: torch.int32}


def weights(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 16, generator=generator).bfloat16(),
            "b": torch.randn(16, generator=generator)}


def fresh_receiver():
    return Receiver({n: torch.zeros_like(t) for n, t in weights().items()})


def same(actual, expected):
    return actual.keys() == expected.keys() and all(
        torch.equal(actual[n].view(BITS[t.element_size()]),
                    expected[n].view(BITS[t.element_size()])) for n, t in expected.items())


def bump(tensors, version):
    new = {n: t.clone() for n, t in tensors.items()}
    new["w"].view(-1)[(version * 131) % new["w"].numel()] += 1
    return new


def test_writer_killed_before_the_manifest_leaves_no_visible_version(tmp_path, monkeypatch):
    """SIGKILL between a version's files and its manifest: readers see nothing new, the
    store stays clean and usable, and a later write works."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    import staged_child

    v1 = weights()
    v2 = bump(v1, 2)
    committed = encode_full(v1, stream_id=STREAM, version=1)
    hanging = encode_delta(v2, {n: diff(v1[n], v2[n]) for n in v1}, stream_id=STREAM,
                           base_version=1, version=2)
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    child = context.Process(target=staged_child.commit_then_hang,
                            args=(str(tmp_path), committed, hanging, ready))
    child.start()
    try:
        assert ready.wait(timeout=60), "the writer never reached its manifest"
        receiver = fresh_receiver()
        reader = StagedReader(tmp_path, receiver)
        written = sorted(os.listdir(tmp_path))
        os.kill(child.pid, signal.SIGKILL)
        child.join(timeout=30)
    finally:
        child.kill()
        child.join()  # reaped even when an assertion above failed
    assert (-signal.SIGKILL, True, True) == (
        child.exitcode, "000000000002-v2-delta.safetensors" in written,
        any(n.startswith(".tmp-") and n.endswith("000000000002.manifest.json")
            for n in written))
    assert ([1], [], True) == (reader.poll(), reader.poll(), same(receiver.weights, v1))
    with StagedLink(tmp_path) as link:
        assert [".lock", "000000000001-v1-full.safetensors", "000000000001.manifest.json"] \
            == sorted(os.listdir(tmp_path))
        sender = Sender(link, stream_id="restarted")
        sender.sync(v2, version=2, changes=dict)
        v3 = bump(v2, 3)
        sender.sync(v3, version=3, changes=lambda: {n: diff(v2[n], v3[n]) for n in v3})
    assert ([2, 3], True) == (reader.poll(), same(receiver.weights, v3))


def test_reader_between_files_and_manifest_sees_nothing_new(tmp_path):
    """A poll while the writer has renamed its files but not its manifest applies nothing."""
    link = StagedLink(tmp_path)
    sender = Sender(link, stream_id=STREAM)
    v1 = weights()
    sender.sync(v1, version=1, changes=dict)
    receiver = fresh_receiver()
    reader = StagedReader(tmp_path, receiver)
    reader.poll()
    polled = []
    link._before_commit = lambda: polled.append(
        (reader.poll(), "000000000002-v2-delta.safetensors" in os.listdir(tmp_path)))
    v2 = bump(v1, 2)
    sender.sync(v2, version=2, changes=lambda: {n: diff(v1[n], v2[n]) for n in v2})
    assert [([], True)] == polled
    assert ([2], True) == (reader.poll(), same(receiver.weights, v2))


def test_concurrent_reader_only_ever_holds_committed_versions(tmp_path):
    """A reader polling in a loop while a writer syncs (with anchors) only ever holds a
    version's exact weights, and ends on the last one."""
    history = {0: weights()}
    for version in range(1, 25):
        history[version] = bump(history[version - 1], version)
    receiver = fresh_receiver()
    reader = StagedReader(tmp_path, receiver, verify_weights=True)
    seen, wrong, done = [], [], threading.Event()
    deadline = time.monotonic() + 60

    def read():
        try:
            while time.monotonic() < deadline:
                finished = done.is_set()
                seen.extend(reader.poll())
                if receiver.version is not None and not same(receiver.weights,
                                                             history[receiver.version]):
                    wrong.append(receiver.version)
                if finished:
                    return
        except Exception as exc:
            wrong.append(repr(exc))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    with StagedLink(tmp_path) as link:
        sender = Sender(link, anchor_interval=4, stream_id=STREAM)
        for version in range(1, len(history)):
            old, new = history[version - 1], history[version]
            sender.sync(new, version=version,
                        changes=lambda old=old, new=new: {n: diff(old[n], new[n]) for n in new})
    done.set()
    thread.join(timeout=60)
    assert ([], sorted(set(seen)), len(history) - 1) == (wrong, seen, receiver.version)
