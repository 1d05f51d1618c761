"""AReaL's awex trainer adapter, sending each Megatron rank's changes instead of the model.

`DeltaAwexMegatronAdapter` keeps AReaL's ``AwexMegatronAdapter`` for everything but the
steps of a separated weight update (and ``batch_isend_irecv``, `awex_link.warm_up`):

- ``get_weight_metadata``: the Hugging Face names and full shapes this rank holds pieces
  of, read off ``dte_codec``'s Megatron geometry instead of gathering every parameter
  over TP (AReaL's adapter reports the same names and shapes, gathered);
- ``init_weight_update_group``: awex's plan as AReaL builds it, the rollout's shards and
  the group (`awex_link.connect`), and a ``GroupSender`` whose plan maps this rank's
  Megatron shard onto every rollout rank;
- ``execute_weight_update``: the local model params as they are, the change sets of
  `areal_dte.megatron.attach` (attached at the first update), ``GroupSender.sync`` over
  the group (agreement, two rounds, vote: a refused delta is sent again in full), and
  the detector's commit once the version was acknowledged. No parameter is gathered.

`install` puts the class where AReaL's train worker looks its adapter up.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from dte_codec.geometry import plan
from dte_codec.layouts import ModelConfig, canonical_tensors
from dte_codec.megatron_layout import MegatronLayout, megatron_shard
from dte_config import read_env
from dte_transport import SyncReport
from dte_transport.group import GroupSender

from ..areal_import import areal_module
from ..megatron import MegatronChanges, attach
from ..megatron.shards import named_params
from ..torch_actor import Method
from .awex_link import Connection, connect, warm_up
from .compat import MEGATRON_ADAPTER, check_trainer

__all__ = ["DeltaAwexMegatronAdapter", "install"]

log = logging.getLogger(__name__)

_awex_adapter = areal_module(MEGATRON_ADAPTER[0])
_meta = areal_module("awex.meta.weight_meta")
_NO_SHARDING = areal_module("awex.sharding.param_sharding").ShardingType.NO_SHARDING
_MIB = 1 << 20


class DeltaAwexMegatronAdapter(getattr(_awex_adapter, MEGATRON_ADAPTER[1])):
    """AReaL's Megatron awex adapter with the delta path (see the module docstring).

    Args:
        engine: AReaL's ``MegatronEngine`` (``model``, ``optimizer``, ``hf_config``,
            ``data_parallel_rank``); its model params are bf16.
    """

    def __init__(self, engine: Any):
        super().__init__(engine)
        self.delta = read_env(os.environ)
        self.config = ModelConfig.from_hf(engine.hf_config)
        self.sender: GroupSender | None = None
        self.link: Connection | None = None
        self.changes: MegatronChanges | None = None
        self.last_report: SyncReport | None = None

    def get_weight_metadata(self) -> list:
        """One AReaL-shaped meta (whole tensor, replicated) per canonical tensor that
        this rank holds a piece of."""
        info = self._build_rank_info()
        shard = self._shard()
        held = {piece.canonical: shard.tensors[piece.tensor].dtype for piece in shard.pieces}
        full = canonical_tensors(self.config)
        out = []
        for name, dtype in held.items():
            shape = tuple(full[name].shape)
            numel = int(torch.Size(shape).numel())
            shard_meta = _meta.ParameterShardMeta(
                tp_rank=info.tp_rank, attn_tp_rank=info.attn_tp_rank, pp_rank=info.pp_rank,
                ep_rank=info.ep_rank, ep_tp_rank=info.ep_tp_rank,
                global_rank=info.global_rank, world_size=info.world_size,
                engine_rank=info.engine_rank, cp_rank=info.cp_rank, cp_size=info.cp_size,
                cp_mode=info.cp_mode, name=name, shape=shape, numel=numel,
                dtype=dtype, global_offset=(0,) * len(shape),
                sharding_type=_NO_SHARDING, num_shards=1, sharding_dim=0)
            out.append(_meta.ParameterMeta(
                name=name, global_numel=numel, global_shape=shape, dtype=dtype,
                shards=[shard_meta], replicas=[_meta.ParameterReplicaMeta(shards=[shard_meta])]))
        return out

    def init_weight_update_group(self, pair_name: str, master_addr: str, master_port: int,
                                 transfer_rank: int, world_size: int, kv_store_url: str,
                                 infer_world_size: int, train_world_size: int,
                                 num_engines: int) -> None:
        """Plan against the rollout's shards and join the group (a new trajectory: the
        first version after it is full)."""
        link = connect(
            config=self.config, pair_name=pair_name, master_addr=master_addr,
            master_port=master_port, transfer_rank=transfer_rank, world_size=world_size,
            kv_store_url=kv_store_url, infer_world_size=infer_world_size,
            train_world_size=train_world_size, num_engines=num_engines)
        self._transfer_rank, self._transfer_plan = transfer_rank, link.awex_plan
        self._weights_update_group, self.link = link.group, link
        shard = self._shard()
        transfers = plan(shard, list(link.rollout_shards)) if self._sends() else {}
        self.sender = GroupSender(transfers, roles=link.roles, stream_id=link.stream_id,
                                  group=link.group, device=link.device,
                                  anchor_interval=self.delta.weight_update_anchor_interval)

    def batch_isend_irecv(self, **kwargs) -> None:
        """AReaL's liveness exchange after connecting, on this group (`awex_link.warm_up`)."""
        warm_up(self.link)

    def execute_weight_update(self, version: int) -> None:
        """Deliver ``version``: a delta of this rank's changes when every rank agrees,
        else (or after a refusal) in full.

        Raises:
            RuntimeError: no group yet (as AReaL's adapter).
            dte_transport.SyncError: not even a full sync was accepted, or the group failed;
                every trainer rank raises it, after the same collectives.
        """
        if self.sender is None:
            raise RuntimeError("Weight update group is not initialized")
        if self.changes is None:
            window = self.delta.weight_update_delta_performance.inversion_allreduce_window_mb
            self.changes = attach(self._engine.optimizer, self._engine.model,
                                  method=Method(self.delta.weight_update_delta_method.value),
                                  window_bytes=window * _MIB)
        weights = self._local_weights()
        reason = self.changes.full_reason
        request = getattr(self._engine, "take_full_sync_request", lambda _: None)(version)
        if request is not None:  # the controller's second attempt after a rollout refused
            reason = f"refused by the rollout: {request.reason}"
        if reason is None:
            report = self.sender.sync(weights, version=version, changes=self.changes.collect)
        else:
            report = self.sender.sync_full(weights, version=version, reason=reason)
        self.changes.commit()
        self.last_report = report
        if self.delta.weight_update_delta_diagnostics.phase_timing:
            log.info("v%d %s phases: %s", version, report.kind.value,
                     ", ".join(f"{phase} {ms:.1f} ms" for phase, ms in report.ms.items()))

    def _shard(self):
        from megatron.core import parallel_state as mpu

        layout = MegatronLayout(tp=mpu.get_tensor_model_parallel_world_size(),
                                pp=mpu.get_pipeline_model_parallel_world_size(),
                                ep=mpu.get_expert_model_parallel_world_size())
        rank = (mpu.get_pipeline_model_parallel_rank() * layout.tp * layout.ep
                + mpu.get_expert_model_parallel_rank() * layout.tp
                + mpu.get_tensor_model_parallel_rank())
        return megatron_shard(self.config, layout, rank=rank)

    def _sends(self) -> bool:
        """One data-parallel replica sends (the layout's DP == EP: rank ``ep`` of each)."""
        from megatron.core import parallel_state as mpu

        return self._engine.data_parallel_rank == mpu.get_expert_model_parallel_rank()

    def _local_weights(self) -> dict[str, torch.Tensor]:
        """The model params of this rank under bare ``GPTModel`` names, looked up now."""
        return {name: param.data for name, param in named_params(self._engine.model).items()}


def install() -> None:
    """Make AReaL's train worker build `DeltaAwexMegatronAdapter` (after the checks).

    Raises:
        IncompatibleStackError: the stack differs from the one this was written for.
    """
    check_trainer()
    setattr(_awex_adapter, MEGATRON_ADAPTER[1], DeltaAwexMegatronAdapter)
