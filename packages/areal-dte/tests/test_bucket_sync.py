"""BucketSync: AReaL-style buckets of Hugging Face-named tensors, one version per walk."""

import pytest
import torch
from areal_dte.bucket_sync import RESYNC, BucketSync
from areal_dte.errors import DeltaSyncError
from bitwise import assert_same_bits
from dte_codec import Header
from dte_detector import diff
from dte_transport import LinkError, Loopback, Receiver, Sender, SyncError, SyncKind

SHAPES = {
    "model.embed_tokens.weight": (96, 32),
    "model.layers.0.self_attn.qkv_proj.weight": (64, 32),
    "model.layers.0.mlp.experts.0.down_proj.weight": (32, 48),
    "model.norm.weight": (32,),
}


class Trainer:
    """fp32 masters stepped by a real AdamW; the bf16 cast is what the rollout needs."""

    def __init__(self):
        torch.manual_seed(0)
        self.masters = {n: torch.nn.Parameter(torch.randn(s) * 0.02) for n, s in SHAPES.items()}
        self.optimizer = torch.optim.AdamW(self.masters.values(), lr=3e-4, weight_decay=0.01)

    def step(self):
        for param in self.masters.values():
            param.grad = torch.randn_like(param)
        self.optimizer.step()

    def weights(self):
        return {n: p.detach().to(torch.bfloat16) for n, p in self.masters.items()}

    def buckets(self):
        """The weights in AReaL's hand-over shape: lists of (name, tensor), two buckets."""
        items = list(self.weights().items())
        return [items[:2], items[2:]]


class LossyLink:
    """Passes payloads on to a link, except that it loses ``losses[v]`` sends of version v."""

    def __init__(self, link, losses):
        self.link, self.losses = link, dict(losses)

    def send(self, data):
        version = Header.unpack(memoryview(bytes(data)))[0].payload_version
        if self.losses.get(version, 0):
            self.losses[version] -= 1
            raise LinkError(f"v{version} lost")
        return self.link.send(data)


def setup(*, anchor_interval=20, losses=()):
    trainer = Trainer()
    rollout = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in SHAPES.items()}
    link = LossyLink(Loopback(Receiver(rollout)), losses)
    return trainer, rollout, BucketSync(Sender(link, anchor_interval=anchor_interval))


def sync(buckets, trainer, version):
    for bucket in trainer.buckets():
        buckets.add(bucket, version=version)
    return buckets.sync(version=version)


def test_full_then_deltas_equal_the_new_weights():
    """v1 is full, later versions are deltas (an anchor after 2), each bitwise the weights."""
    trainer, rollout, buckets = setup(anchor_interval=2)
    kinds, changed = [], []
    for version in range(1, 5):
        before = trainer.weights()
        if version > 1:
            trainer.step()
        report = sync(buckets, trainer, version)
        assert_same_bits(trainer.weights(), rollout)
        kinds.append(report.kind)
        expected = sum(len(diff(before[n], t)) for n, t in trainer.weights().items())
        changed.append((report.changed, expected) if report.kind is SyncKind.DELTA else None)
    assert [SyncKind.FULL, SyncKind.DELTA, SyncKind.DELTA, SyncKind.ANCHOR] == kinds
    assert all(c is None or (c[0] == c[1] and c[0] > 0) for c in changed), changed


def test_undelivered_version_goes_again_in_full():
    """A delta the link could not deliver is followed by a full sync of the same version."""
    trainer, rollout, buckets = setup(losses={2: 1})
    sync(buckets, trainer, 1)
    trainer.step()
    report = sync(buckets, trainer, 2)
    assert (SyncKind.FULL, f"{RESYNC}: link failed: v2 lost") == (report.kind, report.reason)
    assert_same_bits(trainer.weights(), rollout)
    trainer.step()
    assert SyncKind.DELTA == sync(buckets, trainer, 3).kind
    assert_same_bits(trainer.weights(), rollout)


def test_version_lost_twice_raises_and_rollout_keeps_its_bits():
    """No silent fallback: a version lost on both tries raises; the rollout keeps v1."""
    trainer, rollout, buckets = setup(losses={2: 2})
    sync(buckets, trainer, 1)
    held = {n: t.clone() for n, t in rollout.items()}
    trainer.step()
    with pytest.raises(SyncError) as caught:
        sync(buckets, trainer, 2)
    assert "v2 lost" in str(caught.value)
    assert_same_bits(held, rollout)
    assert SyncKind.FULL == sync(buckets, trainer, 3).kind
    assert_same_bits(trainer.weights(), rollout)


def test_buckets_of_an_unsent_version_are_dropped():
    """A walk that failed midway leaves buckets behind; the next version starts afresh."""
    trainer, rollout, buckets = setup()
    sync(buckets, trainer, 1)
    trainer.step()
    buckets.add(trainer.buckets()[0], version=2)  # v2's walk stops after one bucket
    trainer.step()
    report = sync(buckets, trainer, 3)
    assert (SyncKind.DELTA, 1) == (report.kind, report.base_version)
    assert_same_bits(trainer.weights(), rollout)


def test_a_tensor_handed_over_twice_is_refused():
    """The same name twice in one version is an error, not a silent overwrite."""
    trainer, _, buckets = setup()
    bucket = trainer.buckets()[0]
    buckets.add(bucket, version=1)
    with pytest.raises(DeltaSyncError) as caught:
        buckets.add(bucket[:1], version=1)
    expected = ("v1 tensor 'model.embed_tokens.weight': expected handed over once, got a "
                "second time")
    assert expected == str(caught.value)


def test_sync_without_buckets_is_refused():
    """Sending a version that no bucket was added for raises, naming what was there."""
    trainer, _, buckets = setup()
    buckets.add(trainer.buckets()[0], version=1)
    with pytest.raises(DeltaSyncError) as caught:
        buckets.sync(version=2)
    assert "v2 tensors: expected at least one bucket added, got buckets of v1" == str(caught.value)


def test_a_walk_that_missed_a_tensor_is_refused():
    """A version whose buckets lack a tensor of the last one is refused before anything
    is sent (it would have gone out as a delta that leaves that tensor stale).

    Reproduction: v1 with every bucket, step, v2 with only the first bucket.
    """
    trainer, rollout, buckets = setup()
    sync(buckets, trainer, 1)
    held = {n: t.clone() for n, t in rollout.items()}
    trainer.step()
    buckets.add(trainer.buckets()[0], version=2)
    with pytest.raises(DeltaSyncError) as caught:
        buckets.sync(version=2)
    assert ("v2 tensors: expected the 4 tensors sent before, got 2, missing "
            "['model.layers.0.mlp.experts.0.down_proj.weight', 'model.norm.weight'], new []"
            ) == str(caught.value)
    assert_same_bits(held, rollout)
    assert 1 == buckets.sender.link.link.messages
    assert SyncKind.DELTA == sync(buckets, trainer, 3).kind
    assert_same_bits(trainer.weights(), rollout)
