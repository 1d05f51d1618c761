"""Stateful model of sender and receiver under faults: the receiver always holds exactly
one whole version it was sent (or none), and syncing goes on after every fault."""

from __future__ import annotations

import torch
from areal_dte import Method, TorchActor
from bitwise import assert_same_bits
from dte_codec import Frame
from dte_transport import LinkError, Loopback, Receiver, Sender, SyncError
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

SHAPES = {"embed": (48, 16), "norm": (16,), "scalar": ()}


class FaultyLink(Loopback):
    """A loopback that can corrupt one payload, or lose it before or after delivery."""

    def __init__(self, receiver: Receiver):
        super().__init__(receiver)
        self.fault: str | None = None
        self.corrupt_at = 0

    def send(self, frame: Frame) -> object:
        fault, self.fault = self.fault, None
        if fault == "corrupt":
            frame = _corrupted(frame, self.corrupt_at % frame.nbytes)
        if fault == "lose_payload":
            raise LinkError("payload lost")
        ack = super().send(frame)
        if fault == "lose_ack":
            raise LinkError("acknowledgement lost")
        return ack


def _corrupted(frame: Frame, at: int) -> Frame:
    """``frame`` with byte ``at`` of its payload changed: in the host header, or in a
    copy of the body segment that holds it (on its device)."""
    if at < len(frame.header):
        header = bytearray(frame.header)
        header[at] ^= 0x5A
        return Frame(bytes(header), frame.segments)
    segments, at = [s.clone() for s in frame.segments], at - len(frame.header)
    for segment in segments:
        if at < segment.numel():
            segment[at] ^= 0x5A
            break
        at -= segment.numel()
    return Frame(frame.header, segments)


class SyncMachine(RuleBasedStateMachine):
    @initialize(method=st.sampled_from(list(Method)), anchor=st.integers(0, 3),
                seed=st.integers(0, 2**16))
    def start(self, method, anchor, seed):
        self.gen = torch.Generator().manual_seed(seed)
        self.masters = {n: torch.nn.Parameter(torch.randn(s, generator=self.gen) * 0.02)
                        for n, s in SHAPES.items()}
        optimizer = torch.optim.AdamW(self.masters.values(), lr=1e-4, weight_decay=0.01)
        self.link = FaultyLink(self.fresh_receiver())
        self.actor = TorchActor(self.masters, optimizer,
                                Sender(self.link, anchor_interval=anchor), method=method)
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self.version = 0

    def fresh_receiver(self) -> Receiver:
        return Receiver({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in SHAPES.items()})

    @rule()
    def step(self):
        for param in self.masters.values():
            param.grad = torch.randn(param.shape, generator=self.gen)
        self.actor.step()

    @rule()
    def sync(self):
        self.version += 1
        self.versions[self.version] = {n: t.clone() for n, t in self.actor.model.items()}
        try:
            self.actor.sync(self.version)
        except SyncError:
            assert self.actor.sender.acknowledged is None
            return
        assert self.version == self.link.receiver.version

    @rule(at=st.integers(0, 10_000))
    def corrupt_next_payload(self, at):
        self.link.fault, self.link.corrupt_at = "corrupt", at

    @rule(fault=st.sampled_from(["lose_payload", "lose_ack"]))
    def lose_next(self, fault):
        self.link.fault = fault

    @rule()
    def restart_receiver_without_base(self):
        self.link.receiver = self.fresh_receiver()

    @precondition(lambda self: len(self.versions) > 1)
    @rule(data=st.data())
    def restart_receiver_from_old_version(self, data):
        old = data.draw(st.sampled_from(sorted(self.versions)[:-1]))
        receiver = self.fresh_receiver()
        for name, tensor in self.versions[old].items():
            receiver.weights[name].copy_(tensor)
        receiver.version, receiver.stream_id = old, self.actor.sender.stream_id
        self.link.receiver = receiver

    @invariant()
    def receiver_holds_one_whole_version(self):
        receiver = getattr(getattr(self, "link", None), "receiver", None)
        if receiver is not None and receiver.version is not None:
            assert_same_bits(self.versions[receiver.version], receiver.weights)


TestSyncMachine = SyncMachine.TestCase
