"""End to end: a torch AdamW trainer syncs bf16 weights through a staged-file store."""

import pytest
import torch
from dte_codec import digests
from dte_transport import Receiver, Sender, StagedLink, StagedReader, SyncKind

import areal_dte

VERSIONS = 14
ANCHOR_INTERVAL = 4


@pytest.mark.parametrize("method", list(areal_dte.Method), ids=lambda m: m.value)
def test_every_version_through_the_store_is_bitwise_the_trainers(tmp_path, method):
    """TorchActor + Sender(StagedLink) + StagedReader: after every poll the rollout's
    weights are the trainer's bf16 model copy bit for bit, through deltas and anchors."""
    torch.manual_seed(0)
    masters = {"layer.w": torch.nn.Parameter(torch.randn(128, 64) * 0.02),
               "layer.b": torch.nn.Parameter(torch.zeros(64)),
               "norm.g": torch.nn.Parameter(torch.ones(64))}
    optimizer = torch.optim.AdamW(masters.values(), lr=1e-3, weight_decay=0.01)
    receiver = Receiver({n: torch.zeros(p.shape, dtype=torch.bfloat16)
                         for n, p in masters.items()})
    reader = StagedReader(tmp_path, receiver, verify_weights=True)
    kinds, applied, mismatched = [], [], []
    with StagedLink(tmp_path) as link:
        actor = areal_dte.TorchActor(masters, optimizer,
                                     Sender(link, anchor_interval=ANCHOR_INTERVAL),
                                     method=method)
        for version in range(1, VERSIONS + 1):
            if version > 1:
                for param in masters.values():
                    param.grad = torch.randn_like(param)
                actor.step()
            kinds.append(actor.sync(version).kind)
            applied += reader.poll()
            mismatched += [(version, n) for n, t in actor.model.items()
                           if not torch.equal(t.view(torch.int16),
                                              receiver.weights[n].view(torch.int16))]
    assert [] == mismatched
    assert (list(range(1, VERSIONS + 1)), VERSIONS, digests(actor.model)) == (
        applied, receiver.version, digests(receiver.weights))
    expected_kinds = [SyncKind.FULL] + [
        SyncKind.ANCHOR if v % (ANCHOR_INTERVAL + 1) == 1 else SyncKind.DELTA
        for v in range(2, VERSIONS + 1)]
    assert expected_kinds == kinds
