"""The two ranks of the ``XcclLink`` tests, each a spawned process in one gloo group.

Rank 0 (`head`) is the trainer's pipeline head: for each command of the test process it
builds an ``XcclLink`` whose rollout handle is `RolloutHandle`, runs it, and sends back
the outcome and how many requests the handle made. Rank 1 (`worker`) is one SGLang TP
worker: it answers each request as SGLang's ``update_weights_from_distributed`` does
(`update_weights_from_distributed`), loading into the server the request names
(`Server`), and puts every answer with that server's weights on a queue for the test.
"""

from __future__ import annotations

import datetime
import itertools
import os
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

import attrs
import numpy as np
import torch
import torch.distributed as dist
from areal_dte.errors import DeltaSyncError, PayloadRejectedError
from areal_dte.sglang_receiver import PAYLOAD_TENSOR
from areal_dte.xccl_link import XcclLink
from dte_codec import encode_full
from dte_detector import diff
from dte_transport import Receiver, Sender, SyncError

GROUP_NAME = "dte-xccl-test"
META = SimpleNamespace(nccl_group_name=GROUP_NAME)
"""What ``XcclLink`` reads of AReaL's ``WeightUpdateMeta``."""
TIMEOUT = datetime.timedelta(seconds=60)
SHAPES = {
    "model.embed_tokens.weight": (64, 16),
    "model.layers.0.self_attn.q_proj.weight": (16, 16),
    "model.layers.0.mlp.down_proj.weight": (16, 24),
    "model.layers.0.mlp.gate.weight": (7, 3),
    "model.norm.weight": (16,),
}
SPECIALS = (0x0000, 0x7FC1, 0x0001, 0x7F80)
"""The first four elements of every tensor at version 1: +0, a NaN, the least subnormal,
+inf; every later version flips their sign bits."""
SIGN = -0x8000
CHANGED = 0.03
"""The share of elements each version redraws."""

SUCCESS = "Succeeded to update parameter online."
SESSION = ("update_weights_from_distributed must run between begin_weight_update() and "
           "end_weight_update()")
"""SGLang 0.5.23's refusal outside a weight-update session: a refusal not the receiver's."""

WRONG_BASE, CORRUPT = "wrong_base", "corrupt"
OK, RAISED = "ok", "raised"
DAMAGED = 3
"""The request whose payload arrives at the ``"receiver-corrupt"`` server with its last
byte flipped (damage in flight)."""


def sglang_failure(exc: object) -> str:
    """SGLang's answer when the load of ``update_weights_from_distributed`` raises ``exc``."""
    return (f"Failed to update parameter online: {exc}. The full weights of the ModelRunner "
            "are partially updated. Please discard the whole weights.")


def as_bits(weights: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The weights' integer views, to be compared bit for bit in the test process."""
    return {name: t.view(torch.int16).numpy().copy() for name, t in weights.items()}


def trajectory(count: int) -> dict[int, dict[str, torch.Tensor]]:
    """Versions 1 to ``count`` of bf16 weights drawn as raw bit patterns (so NaN, ±inf,
    ±0 and subnormals among them); each version redraws `CHANGED` of the elements."""
    gen = torch.Generator().manual_seed(0)
    bits = {name: _draw(shape, gen) for name, shape in SHAPES.items()}
    for tensor in bits.values():
        tensor.view(-1)[:len(SPECIALS)] = torch.tensor(SPECIALS, dtype=torch.int16)
    versions = {}
    for version in range(1, count + 1):
        if version > 1:
            for tensor in bits.values():
                redraw = torch.rand(tensor.shape, generator=gen) < CHANGED
                tensor[redraw] = _draw(tensor.shape, gen)[redraw]
                tensor.view(-1)[:len(SPECIALS)] ^= SIGN
        versions[version] = {name: t.clone().view(torch.bfloat16) for name, t in bits.items()}
    return versions


def _draw(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-2**15, 2**15, shape, dtype=torch.int16, generator=gen)


@attrs.frozen
class RolloutHandle:
    """Stands in for AReaL's rollout handle (``RolloutCallback``, whose HTTP round trip
    through the controller reaches every server): sends the request SGLang gets to one
    server's worker and returns a future of the answer, which raises on failure."""

    requests: Connection
    server: str
    answers: ThreadPoolExecutor
    sent: list[str] = attrs.field(factory=list)
    """The names of every request made, in order."""

    def update_weights_from_distributed(self, meta: Any, param_specs: Sequence[Any]
                                        ) -> Future[None]:
        self.sent.append(",".join(spec.name for spec in param_specs))
        self.requests.send((self.server, {
            "names": [spec.name for spec in param_specs],
            "dtypes": [spec.dtype for spec in param_specs],
            "shapes": [spec.shape for spec in param_specs],
            "group_name": meta.nccl_group_name}))
        return self.answers.submit(self._answer)

    def _answer(self) -> None:
        success, message = self.requests.recv()
        if not success:
            raise RuntimeError(message)


def head(store: str, control: Connection, requests: Connection) -> None:
    """Rank 0's life: each command ``(action, server, *args)`` from ``control`` runs an
    ``XcclLink`` to ``server`` and answers ``(OK or RAISED, outcome, requests made)``;
    ``None`` ends it."""
    group = _join(0, store)
    with ThreadPoolExecutor(max_workers=1) as answers:
        while (command := control.recv()) is not None:
            action, server, *args = command
            handle = RolloutHandle(requests=requests, server=server, answers=answers)
            link = XcclLink(rollout=handle, meta=META, group=group, device=torch.device("cpu"))
            try:
                status, outcome = OK, ACTIONS[action](link, *args)
            except Exception:  # the process edge: the test process fails with it
                status, outcome = RAISED, traceback.format_exc()
            control.send((status, outcome, len(handle.sent)))
    requests.send(None)
    _leave()


def check(link: XcclLink) -> str:
    try:
        link.check()
    except DeltaSyncError as exc:
        return f"DeltaSyncError: {exc}"
    return "passed"


def sync(link: XcclLink, fault: str) -> tuple[list[str], dict[int, dict[str, np.ndarray]]]:
    """Versions 1 to 4 through a ``Sender`` over ``link``, version 3 twice: first a delta
    that arrives damaged (``CORRUPT``: the far side's server damages it) or onto a base
    the far side no longer holds (``WRONG_BASE``: it was sent version 1 again), then in
    full. Returns each sync's outcome and every version's bits."""
    versions = trajectory(4)
    sender = Sender(link, anchor_interval=0)

    def deliver(version: int) -> str:
        weights = versions[version]
        try:
            report = sender.sync(weights, version=version, changes=lambda: {
                name: diff(versions[sender.acknowledged][name], tensor)
                for name, tensor in weights.items()})
        except SyncError as exc:
            return f"SyncError: {exc}"
        return f"{report.kind.value} {report.reason}"

    outcomes = [deliver(1), deliver(2)]
    if fault == WRONG_BASE:
        link.send(encode_full(versions[1], stream_id=sender.stream_id, version=1))
    outcomes += [deliver(3), deliver(3), deliver(4)]
    return outcomes, {version: as_bits(weights) for version, weights in versions.items()}


ACTIONS: dict[str, Callable[..., Any]] = {"check": check, "sync": sync}


@attrs.define
class Server:
    """One rollout server's model as far as its ``load_weights`` goes."""

    load_weights: Callable[[list[tuple[str, torch.Tensor]]], None]
    weights: dict[str, torch.Tensor] = attrs.field(factory=dict)

    @classmethod
    def named(cls, name: str) -> Server:
        """``"plain"``: SGLang's loader, which skips names it does not know; ``"session"``:
        a server that refuses every update with `SESSION`; any other name: a model whose
        load hands the payload to areal-dte's receiver, holding no version yet (under
        ``"receiver-corrupt"`` the payload of its `DAMAGED` request arrives damaged)."""
        if name == "plain":
            return cls(lambda named_tensors: None)
        if name == "session":
            return cls(_outside_session)
        weights = {n: torch.zeros(shape, dtype=torch.bfloat16) for n, shape in SHAPES.items()}
        receiver, requests = Receiver(weights), itertools.count(1)

        def load_weights(named_tensors: list[tuple[str, torch.Tensor]]) -> None:
            if next(requests) == DAMAGED and name == f"receiver-{CORRUPT}":
                [(tensor_name, tensor)] = named_tensors
                damaged = tensor.clone()
                damaged[-1] ^= 0xFF
                named_tensors = [(tensor_name, damaged)]
            _load_payload(receiver, named_tensors)
        return cls(load_weights, weights)


def _outside_session(named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    raise RuntimeError(SESSION)


def _load_payload(receiver: Receiver, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """What areal-dte's plugin-routed load does with a payload, over plain tensors."""
    [(name, tensor)] = named_tensors
    if name != PAYLOAD_TENSOR:
        raise ValueError(f"expected one tensor {PAYLOAD_TENSOR!r}, got {name!r}")
    ack = receiver.receive(memoryview(tensor.numpy()))
    if not ack.accepted:
        raise PayloadRejectedError(ack)


def worker(store: str, requests: Connection, far: Any) -> None:
    """Rank 1's life: answers each ``(server, request)`` until ``None``; puts
    ``(server, success, message, the server's weights as bits)`` on ``far`` first."""
    group = _join(1, store)
    servers: dict[str, Server] = {}
    while (request := requests.recv()) is not None:
        name, payload = request
        if name not in servers:
            servers[name] = Server.named(name)
        server = servers[name]
        success, message = update_weights_from_distributed(payload, group=group,
                                                           load_weights=server.load_weights)
        far.put((name, success, message, as_bits(server.weights)))
        requests.send((success, message))
    _leave()


def update_weights_from_distributed(request: dict, *, group: Any, load_weights: Callable
                                    ) -> tuple[bool, str]:
    """SGLang 0.5.10.post1's ``ModelRunner.update_weights_from_distributed`` in brief: join
    the broadcast of each named tensor, hand them to ``load_weights``, answer."""
    try:
        named_tensors = []
        for name, dtype, shape in zip(request["names"], request["dtypes"], request["shapes"]):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            dist.broadcast(tensor, src=0, group=group)
            named_tensors.append((name, tensor))
        load_weights(named_tensors)
    except Exception as exc:  # the process edge: SGLang answers every failure with its text
        return False, sglang_failure(exc)
    return True, SUCCESS


def _join(rank: int, store: str) -> Any:
    """Join the world of two; return the group of both, as AReaL opens its own."""
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=2,
                            timeout=TIMEOUT)
    return dist.new_group([0, 1], backend="gloo", timeout=TIMEOUT)


def _leave() -> None:
    """End once both ranks are done, skipping gloo's teardown (it has aborted finished
    ranks whose peer was still closing its connections)."""
    dist.barrier()
    os._exit(0)
