"""AReaL's awex SGLang adapter, applying the trainers' deltas into the live parameters.

`DeltaAwexSGLangAdapter` keeps AReaL's ``AwexSGLangAdapter`` (its weight metas, which
awex matches against the trainers', its parallelism report) and replaces two steps
(and ``batch_isend_irecv``, `awex_link.warm_up`):

- ``init_weight_update_group``: awex's plan, this rank's shard in ``dte_codec``'s SGLang
  geometry and the group (`awex_link.connect`), and a ``GroupReceiver``;
- ``execute_weight_update``: the model's parameters looked up afresh (SGLang may have
  replaced them since), one ``GroupReceiver.sync`` (agreement, two rounds, the rank's
  own checks of stream, base version and payload, a vote before any write, a write that
  is all or nothing, and a full round of the same version after a refused delta), then
  SGLang's KV/radix cache flushed, since the awex path never flushes it.

It runs inside SGLang's scheduler RPC, which every TP rank answers and then meets at a
barrier, so it never raises before the group's collectives are done: a problem found
first (parameters that do not fit the shard) becomes this rank's refusal, and the
error is raised at the end, where AReaL's gateway reports it.

`install` puts the class where AReaL's scheduler bridge looks its adapter up.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from dte_codec.errors import GeometryError
from dte_codec.layouts import ModelConfig
from dte_transport.group import GroupReceiver

from ..areal_import import areal_module
from ..errors import DeltaSyncError, PayloadRejectedError
from .awex_link import Connection, connect, warm_up
from .compat import SGLANG_ADAPTER, check_rollout

__all__ = ["DeltaAwexSGLangAdapter", "install"]

log = logging.getLogger(__name__)

_awex_adapter = areal_module(SGLANG_ADAPTER[0])


class DeltaAwexSGLangAdapter(getattr(_awex_adapter, SGLANG_ADAPTER[1])):
    """AReaL's SGLang awex adapter with the delta path (see the module docstring).

    Args:
        scheduler: SGLang's ``Scheduler`` of this TP rank (``tp_worker.model_runner.model``,
            ``server_args``, ``flush_cache``).
    """

    def __init__(self, scheduler: Any):
        super().__init__(scheduler)
        self.receiver: GroupReceiver | None = None
        self.link: Connection | None = None
        self.shard = None

    def init_weight_update_group(self, pair_name: str, master_addr: str, master_port: int,
                                 transfer_rank: int, world_size: int, kv_store_url: str,
                                 infer_world_size: int, train_world_size: int,
                                 num_engines: int) -> None:
        """Plan this rank's shard and join the group; the rank holds no version of the
        new trajectory until its first full sync."""
        link = connect(
            config=ModelConfig.from_hf(self._get_model().config), pair_name=pair_name,
            master_addr=master_addr, master_port=master_port, transfer_rank=transfer_rank,
            world_size=world_size, kv_store_url=kv_store_url,
            infer_world_size=infer_world_size, train_world_size=train_world_size,
            num_engines=num_engines)
        self._transfer_rank, self._transfer_plan = transfer_rank, link.awex_plan
        self._weights_update_group, self.link = link.group, link
        self.shard = link.rollout_shards[transfer_rank]
        # the shard: a full version covers only the elements it holds (no vocab padding)
        self.receiver = GroupReceiver({}, roles=link.roles, group=link.group, device=link.device,
                                      shard=self.shard)

    def batch_isend_irecv(self, **kwargs) -> None:
        """AReaL's liveness exchange after connecting, on this group (`awex_link.warm_up`)."""
        warm_up(self.link)

    def execute_weight_update(self, version: int) -> None:
        """Take part in ``version``'s sync, then flush SGLang's cache.

        Raises:
            RuntimeError: no group yet (as AReaL's adapter).
            PayloadRejectedError: this rank ended without the version (it holds its
                previous one, or none after a failed full write).
            DeltaSyncError: the version arrived under another number, or the cache
                could not be flushed (SGLang was not idle).
            dte_transport.LinkError: a collective failed; nothing was written.
        """
        if self.receiver is None:
            raise RuntimeError("Weight update group is not initialized")
        self.receiver.weights = self._live_weights()
        ack = self.receiver.sync()
        if not ack.accepted:
            raise PayloadRejectedError(ack)
        if ack.version != version:
            raise DeltaSyncError("rollout version", expected=version, got=ack.version)
        # One try: this runs inside the scheduler's loop, so nothing drains while it
        # waits; AReaL's abort-mode pause has emptied the scheduler before the update.
        if not self._scheduler.flush_cache():
            raise DeltaSyncError("KV cache flush after the update",
                                 expected="an idle scheduler", got="requests still held")

    def _live_weights(self) -> dict[str, torch.Tensor]:
        """The model's parameters now, or none (a refusal of every payload) when they no
        longer fit this rank's shard."""
        weights = {name: param.data for name, param in self._get_model().named_parameters()}
        try:
            self.shard.check_tensors(weights)
        except GeometryError as exc:
            log.error("live parameters do not fit the rollout shard (%s); refusing this "
                      "version", exc)
            self.receiver.version = None  # a veto of any delta; the full round is refused
            return {}
        return weights


def install() -> None:
    """Make AReaL's SGLang scheduler bridge build `DeltaAwexSGLangAdapter` (after the
    checks).

    Raises:
        IncompatibleStackError: the stack differs from the one this was written for.
    """
    check_rollout()
    setattr(_awex_adapter, SGLANG_ADAPTER[1], DeltaAwexSGLangAdapter)
