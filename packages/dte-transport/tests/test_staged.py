"""Staged-file store: StagedLink writes committed versions, StagedReader applies them in order."""

import json
import os
import tempfile

import pytest
import safetensors.torch
import torch
import xxhash
from dte_codec import CodecError, Header, digests, encode_delta, encode_full
from dte_detector import diff
from dte_transport import (Ack, CorruptFileError, LinkError, Receiver, Rejection, Sender,
                           StagedLink, StagedReader, SyncError, SyncKind)
from dte_transport.errors import (ManifestError, RejectedVersionError, StoreLockedError,
                                  WeightDigestError)
from hypothesis import given
from hypothesis import strategies as st

STREAM = "stream-a"
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Trainer:
    """A sender over a StagedLink whose weights move a few elements per version."""

    def __init__(self, root, *, anchor_interval=20, stream_id=STREAM, **link_options):
        self.link = StagedLink(root, **link_options)
        self.sender = Sender(self.link, anchor_interval=anchor_interval, stream_id=stream_id)
        generator = torch.Generator().manual_seed(0)
        self.weights = {"w": torch.randn(64, 8, generator=generator).bfloat16(),
                        "b": torch.randn(3, generator=generator)}
        self.history = {}
        self.version = 0

    def sync(self, *, touch=("w",)):
        old = {n: t.clone() for n, t in self.weights.items()}
        self.version += 1
        for name in touch:
            flat = self.weights[name].view(-1)
            flat[(self.version * 37) % flat.numel()] += 1
        report = self.sender.sync(self.weights, version=self.version,
                                  changes=lambda: {n: diff(old[n], t)
                                                   for n, t in self.weights.items()})
        self.history[self.version] = {n: t.clone() for n, t in self.weights.items()}
        return report


def fresh_receiver():
    return Receiver({"w": torch.zeros(64, 8, dtype=torch.bfloat16), "b": torch.zeros(3)})


def bits(tensors):
    return {n: t.view(BITS[t.element_size()]).clone() for n, t in tensors.items()}


def same(actual, expected):
    """Two dicts of tensors are equal bit for bit (compared as integers)."""
    actual, expected = bits(actual), bits(expected)
    return actual.keys() == expected.keys() and all(
        torch.equal(actual[n], expected[n]) for n in expected)


def holds(receiver, expected):
    return same(receiver.weights, expected)


def manifests(root):
    names = sorted(n for n in os.listdir(root) if n.endswith(".manifest.json"))
    return [json.loads((root / n).read_text()) for n in names]


def test_full_version_is_a_usable_checkpoint(tmp_path):
    """A full version is plain safetensors of the tensors, loadable without this package."""
    trainer = Trainer(tmp_path)
    trainer.sync()
    (manifest,) = manifests(tmp_path)
    (file,) = manifest["files"]
    loaded = safetensors.torch.load_file(tmp_path / file["name"])
    assert ("000000000001-v1-full.safetensors", 1, "full", None, True) == (
        file["name"], manifest["version"], manifest["kind"], manifest["base_version"],
        same(loaded, trainer.weights))


def test_manifest_records_kinds_bases_and_digests(tmp_path):
    """Each manifest names its kind and base and the digests of the weights after it."""
    trainer = Trainer(tmp_path, anchor_interval=2)
    for _ in range(3):
        trainer.sync(touch=("w", "b"))
    trainer.sync()  # the anchor: prunes 1..3
    trainer.sync()
    got = [(m["version"], m["kind"], m["base_version"], m["tensors"]) for m in manifests(tmp_path)]
    assert [(4, "anchor", None, digests(trainer.history[4])),
            (5, "delta", 4, digests(trainer.history[5]))] == got


def test_delta_file_keeps_the_payload_exact(tmp_path):
    """A delta is stored as its exact payload bytes in one uint8 tensor."""
    link = StagedLink(tmp_path)
    source = {"w": torch.arange(8, dtype=torch.float32)}
    link.send(encode_full(source, stream_id=STREAM, version=1))
    new = {"w": source["w"] + torch.tensor([0, 0, 1, 0, 0, 0, 0, 0])}
    data = encode_delta(new, {"w": diff(source["w"], new["w"])}, stream_id=STREAM,
                        base_version=1, version=2)
    assert Ack(accepted=True, version=2) == link.send(data)
    stored = safetensors.torch.load_file(tmp_path / "000000000002-v2-delta.safetensors")
    assert bytes(data) == stored["payload"].numpy().tobytes()


def test_full_version_is_sharded_by_size(tmp_path):
    """Tensors over ``max_file_bytes`` go to several files; the reader loads them all."""
    trainer = Trainer(tmp_path, max_file_bytes=100)
    trainer.sync()
    receiver = fresh_receiver()
    assert [1] == StagedReader(tmp_path, receiver).poll()
    assert (["000000000001-v1-full-00001-of-00002.safetensors",
             "000000000001-v1-full-00002-of-00002.safetensors"], True) == (
        [f["name"] for f in manifests(tmp_path)[0]["files"]], holds(receiver, trainer.weights))


def test_anchor_prunes_older_versions_and_nothing_else(tmp_path):
    """A full version deletes every older version's files; other files stay."""
    (tmp_path / "notes.txt").write_text("mine")
    trainer = Trainer(tmp_path, anchor_interval=2)
    kinds = [trainer.sync().kind for _ in range(4)]
    assert [SyncKind.FULL, SyncKind.DELTA, SyncKind.DELTA, SyncKind.ANCHOR] == kinds
    assert [".lock", "000000000004-v4-anchor.safetensors", "000000000004.manifest.json",
            "notes.txt"] == sorted(os.listdir(tmp_path))


def test_reader_applies_versions_strictly_in_order(tmp_path, monkeypatch):
    """Versions are applied by commit order, whatever order the directory lists them in."""
    trainer = Trainer(tmp_path)
    for _ in range(5):
        trainer.sync()
    listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda path: sorted(listdir(path), reverse=True))
    receiver = fresh_receiver()
    seen = []
    receive = receiver.receive
    receiver.receive = lambda data: seen.append(Header.unpack(memoryview(bytes(data)))[0]
                                                .payload_version) or receive(data)
    reader = StagedReader(tmp_path, receiver)
    assert ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], True) == (reader.poll(), seen,
                                                       holds(receiver, trainer.weights))
    trainer.sync()
    assert ([6], [], 6) == (reader.poll(), reader.poll(), receiver.version)


def test_reader_behind_an_anchor_reseeds_from_it(tmp_path):
    """A reader whose base was pruned by an anchor re-seeds from it, then takes the deltas."""
    trainer = Trainer(tmp_path, anchor_interval=2)
    receiver = fresh_receiver()
    reader = StagedReader(tmp_path, receiver)
    trainer.sync()
    trainer.sync()
    assert [1, 2] == reader.poll()
    kinds = [trainer.sync().kind for _ in range(3)]
    assert [SyncKind.DELTA, SyncKind.ANCHOR, SyncKind.DELTA] == kinds
    assert ([4, 5], True) == (reader.poll(), holds(receiver, trainer.weights))


def test_reader_of_another_stream_reseeds(tmp_path):
    """A restarted trainer (new stream, versions from 1 again) re-seeds every reader."""
    first = Trainer(tmp_path, stream_id="old")
    for _ in range(3):
        first.sync()
    receiver = fresh_receiver()
    reader = StagedReader(tmp_path, receiver)
    reader.poll()
    first.link.close()
    second = Trainer(tmp_path, stream_id="new")
    second.weights["b"] += 5
    second.sync()
    assert ([1], "new", True) == (reader.poll(), receiver.stream_id,
                                  holds(receiver, second.weights))


def test_empty_store_applies_nothing(tmp_path):
    """A store without a committed full version leaves the receiver as it is."""
    receiver = fresh_receiver()
    assert ([], None) == (StagedReader(tmp_path, receiver).poll(), receiver.version)


def test_writer_refuses_a_delta_onto_another_base(tmp_path):
    """A delta the store cannot chain is refused before anything is written."""
    link = StagedLink(tmp_path)
    source = {"w": torch.zeros(4)}
    link.send(encode_full(source, stream_id=STREAM, version=1))
    new = {"w": torch.ones(4)}
    data = encode_delta(new, {"w": diff(source["w"], new["w"])}, stream_id=STREAM,
                        base_version=5, version=6)
    before = sorted(os.listdir(tmp_path))
    assert (Ack(accepted=False, version=1, rejection=Rejection.WRONG_BASE,
                detail="delta onto version 5, holding 1"), before) == (
        link.send(data), sorted(os.listdir(tmp_path)))


def test_writer_refuses_bad_bytes(tmp_path):
    """Bytes that are not a payload are refused with the codec's reason."""
    with pytest.raises(CodecError) as expected:
        Header.unpack(memoryview(b"not a payload"))
    ack = StagedLink(tmp_path).send(b"not a payload")
    assert Ack(accepted=False, version=None, rejection=Rejection.BAD_PAYLOAD,
               detail=str(expected.value)) == ack


def test_write_failure_raises_link_error_and_needs_a_full_sync(tmp_path, monkeypatch):
    """A failed write is a LinkError (a SyncError at the sender), shows no version, and the
    next sync is full."""
    trainer = Trainer(tmp_path)
    trainer.sync()
    receiver = fresh_receiver()
    reader = StagedReader(tmp_path, receiver)
    reader.poll()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("dte_transport.staged.write_durable", full_disk)
    with pytest.raises(SyncError) as raised:
        trainer.sync()
    assert (f"version 2 was not delivered: link failed: staged store {str(tmp_path)!r}: writing "
            "version 2 failed: [Errno 28] No space left on device; the next sync is full",
            LinkError) == (str(raised.value), type(raised.value.__cause__))
    monkeypatch.undo()
    assert ([], 1) == (reader.poll(), receiver.version)
    assert (SyncKind.FULL, [3], True) == (trainer.sync().kind, reader.poll(),
                                          holds(receiver, trainer.weights))


def test_second_writer_is_refused(tmp_path):
    """A store has one writer at a time; closing the first frees it."""
    first = StagedLink(tmp_path)
    with pytest.raises(StoreLockedError) as raised:
        StagedLink(tmp_path)
    assert f"staged store {str(tmp_path)!r} is held by another writer" == str(raised.value)
    first.close()
    StagedLink(tmp_path).close()


def test_corrupted_file_is_detected_by_its_digest(tmp_path):
    """A flipped byte in a committed delta is rejected; the receiver keeps bytes and version."""
    trainer = Trainer(tmp_path)
    trainer.sync()
    receiver = fresh_receiver()
    reader = StagedReader(tmp_path, receiver)
    reader.poll()
    trainer.sync()
    (file,) = manifests(tmp_path)[-1]["files"]
    path = tmp_path / file["name"]
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x10
    path.write_bytes(raw)
    before = {n: t.clone() for n, t in receiver.weights.items()}
    with pytest.raises(CorruptFileError) as raised:
        reader.poll()
    assert (f"staged file {file['name']!r} of version 2: xxh3_128: expected {file['xxh3_128']}, "
            f"got {xxhash.xxh3_128_hexdigest(bytes(raw))}") == str(raised.value)
    assert (1, True) == (receiver.version, holds(receiver, before))


def test_truncated_and_missing_files_are_detected(tmp_path):
    """A committed file of the wrong size or gone entirely is named in the error."""
    Trainer(tmp_path).sync()
    (file,) = manifests(tmp_path)[0]["files"]
    path = tmp_path / file["name"]
    path.write_bytes(path.read_bytes()[:-1])
    receiver = fresh_receiver()
    with pytest.raises(CorruptFileError) as truncated:
        StagedReader(tmp_path, receiver).poll()
    path.unlink()
    with pytest.raises(CorruptFileError) as missing:
        StagedReader(tmp_path, receiver).poll()
    assert ([f"staged file {file['name']!r} of version 1: size: expected {file['size']} bytes, "
             f"got {file['size'] - 1} bytes",
             f"staged file {file['name']!r} of version 1: file: expected present, got missing"],
            None) == ([str(truncated.value), str(missing.value)], receiver.version)


def test_bad_manifest_is_named(tmp_path):
    """A committed manifest with an unknown format version is an error naming it."""
    Trainer(tmp_path).sync()
    path = tmp_path / "000000000001.manifest.json"
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "format_version": 2}))
    with pytest.raises(ManifestError) as raised:
        StagedReader(tmp_path, fresh_receiver()).poll()
    assert ("manifest '000000000001.manifest.json': format_version: expected 1, got 2"
            == str(raised.value))


def test_receiver_refusal_is_a_typed_error(tmp_path):
    """A version the receiver cannot take (other shapes) raises and leaves it as it was."""
    Trainer(tmp_path).sync()
    receiver = Receiver({"w": torch.zeros(4, dtype=torch.bfloat16), "b": torch.zeros(3)})
    with pytest.raises(RejectedVersionError) as raised:
        StagedReader(tmp_path, receiver).poll()
    assert ("version 1 was rejected by the receiver (mismatch): tensor 'w': shape: expected "
            "(4,), got (64, 8); it holds version None", None) == (str(raised.value),
                                                                 receiver.version)


def test_weight_digest_mismatch_drops_the_version_then_reseeds(tmp_path):
    """With ``verify_weights``, a receiver that drifted is caught and re-seeded."""
    trainer = Trainer(tmp_path)
    trainer.sync()
    receiver = fresh_receiver()
    reader = StagedReader(tmp_path, receiver, verify_weights=True)
    reader.poll()
    receiver.weights["b"][0] += 1  # the rollout's copy drifts
    trainer.sync()
    expected = manifests(tmp_path)[-1]["tensors"]["b"]
    got = digests({"b": receiver.weights["b"]})["b"]
    with pytest.raises(WeightDigestError) as raised:
        reader.poll()
    assert (f"tensor 'b' after version 2: digest: expected {expected}, got {got}; the receiver "
            "holds no version now", None) == (str(raised.value), receiver.version)
    assert ([1, 2], True) == (reader.poll(), holds(receiver, trainer.weights))


def test_trainer_digests_keep_a_missed_change_out_of_the_store(tmp_path):
    """With ``Sender(digests=True)`` the manifests carry the trainer's own digests and a
    delta whose detector missed a change is refused before anything is written: the
    version goes in full and a reader lands on the trainer's bits. Without them the
    writer's replay of the wrong delta is what the manifest records, so ``verify_weights``
    could not catch the miss.

    Reproduction: a delta whose change sets leave out one changed element of ``b``.
    """
    for checked in (True, False):
        root = tmp_path / str(checked)
        trainer = Trainer(root)
        trainer.sender = Sender(trainer.link, anchor_interval=20, stream_id=STREAM,
                                digests=checked)
        trainer.sync()
        trainer.weights["b"][0] += 1
        report = trainer.sender.sync(trainer.weights, version=2, changes=lambda: {
            n: diff(t, t) for n, t in trainer.weights.items()})
        receiver = fresh_receiver()
        StagedReader(root, receiver, verify_weights=True).poll()
        if checked:
            assert (SyncKind.FULL, "anchor", True) == (report.kind, manifests(root)[-1]["kind"],
                                                     holds(receiver, trainer.weights))
            assert digests(trainer.weights) == manifests(root)[-1]["tensors"]
        else:
            assert (SyncKind.DELTA, False) == (report.kind, holds(receiver, trainer.weights))


@given(schedule=st.lists(st.tuples(st.sampled_from([(), ("w",), ("b",), ("w", "b")]),
                                   st.booleans()), min_size=1, max_size=8),
       anchor_interval=st.integers(0, 3))
def test_reader_always_lands_on_a_committed_version(schedule, anchor_interval):
    """Polling at any points yields exactly the trainer's weights of the version reached."""
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(root, anchor_interval=anchor_interval)
        receiver = fresh_receiver()
        reader = StagedReader(root, receiver, verify_weights=True)
        for touch, poll in schedule:
            trainer.sync(touch=touch)
            if poll:
                reader.poll()
                assert (trainer.version, True) == (receiver.version,
                                                   holds(receiver, trainer.weights))
        reader.poll()
        trainer.link.close()
        kinds = [m["kind"] for m in manifests(trainer.link.root)]
        assert (trainer.version, True, ["delta"] * (len(kinds) - 1)) == (
            receiver.version, holds(receiver, trainer.weights), kinds[1:])


def test_poll_racing_a_prune_lists_again(tmp_path, monkeypatch):
    """A listing taken just before an anchor pruned it is read again, not half-used."""
    trainer = Trainer(tmp_path, anchor_interval=2)
    for _ in range(3):
        trainer.sync()
    stale = os.listdir(tmp_path)
    trainer.sync()  # the anchor: prunes 1..3
    listdir, calls = os.listdir, []

    def stale_once(path):
        calls.append(path)
        return stale if len(calls) == 1 else listdir(path)

    monkeypatch.setattr(os, "listdir", stale_once)
    receiver = fresh_receiver()
    assert ([4], 2, True) == (StagedReader(tmp_path, receiver).poll(), len(calls),
                              holds(receiver, trainer.weights))
