"""AReaL's Megatron PPO actor, its weight updates sent through the delta path.

AReaL's train workers build this class from its import path (``areal_job.DELTA_ACTOR``),
so importing this module imports AReaL's Megatron engine (`AReaLImportError` when that
stack is missing). The engine reads the ``DTE_*`` variables when it is built, the worker's
start, and holds them to what cluster mode runs (`cluster_rules.check_delta`). With
``DTE_ENABLE_DELTA_WEIGHT_UPDATE=0`` it is AReaL's engine unchanged.

With the path on, AReaL's own walk does what it does for a full update (pause the
rollout, TP and EP gathers, conversion to Hugging Face names and layouts, buckets on the
pipeline head). The one step replaced is the bucket's broadcast,
``_update_bucket_weights_from_distributed``, where both AReaL's registry walk and its bridge
walk hand a bucket over: the bucket goes to a `BucketSync` instead. After the walk the
pipeline head sends the version through an `XcclLink`, the rollout's generation paused
around it, and every rank meets at a barrier as at the end of AReaL's own update.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch.distributed as dist
from dte_config import read_env
from dte_transport import Sender

from ..areal_import import areal_module
from ..bucket_sync import BucketSync
from ..errors import DeltaSyncError
from ..xccl_link import XcclLink
from .cluster_rules import XCCL, check_delta

__all__ = ["DeltaMegatronPPOActor"]

log = logging.getLogger(__name__)

_engine = areal_module("areal.engine.megatron_engine")


class DeltaMegatronPPOActor(_engine.MegatronPPOActor):
    """``MegatronPPOActor`` whose ``update_weights`` sends deltas (see the module docstring).

    Raises:
        ClusterModeError: at construction, ``DTE_*`` settings cluster mode cannot run.
        dte_config.ConfigValidationError: at construction, unparsable ``DTE_*`` variables.
    """

    def __init__(self, config: Any):
        super().__init__(config)
        self.delta = read_env(os.environ)
        check_delta(self.delta)
        self._buckets: BucketSync | None = None
        """The sending side; set by ``connect_engine`` on the pipeline head only."""

    def connect_engine(self, engine: Any, meta: Any) -> None:
        """AReaL's connection (it opens the xccl group), then the delta link on the head.

        Raises:
            DeltaSyncError: the update type is not xccl, or the rollout ignores payloads.
        """
        if not self.delta.enable_delta_weight_update:
            super().connect_engine(engine, meta)
            return
        if meta.type != XCCL:
            raise DeltaSyncError("weight update type", expected=XCCL, got=meta.type)
        super().connect_engine(engine, meta)
        if self.is_pipeline_parallel_head():
            link = XcclLink(rollout=engine, meta=meta, group=self.weight_update_group,
                            device=self.device)
            link.check()
            interval = self.delta.weight_update_anchor_interval
            self._buckets = BucketSync(Sender(link, anchor_interval=interval))

    def update_weights(self, meta: Any) -> None:
        """AReaL's walk collects the buckets; then the head sends the version.

        Raises:
            dte_transport.SyncError: the version was not delivered, even in full.
        """
        super().update_weights(meta)
        if not self.delta.enable_delta_weight_update:
            return
        if self._buckets is not None:
            self._send(meta.version)
        dist.barrier(group=self.cpu_group)

    def _send(self, version: int) -> None:
        self.engine_lock.acquire()  # as AReaL holds it around every exchange with the rollout
        try:
            self.rollout_engine.pause_generation()
            try:
                report = self._buckets.sync(version=version)
            finally:
                self.rollout_engine.continue_generation()
        finally:
            self.engine_lock.release()
        if self.delta.weight_update_delta_diagnostics.phase_timing:
            log.info("v%d %s phases: %s", version, report.kind.value,
                     ", ".join(f"{phase} {ms:.1f} ms" for phase, ms in report.ms.items()))

    def _update_bucket_weights_from_distributed(self, meta: Any, converted_named_tensors: list
                                                ) -> None:
        """AReaL's hand-over of one bucket (on the pipeline head): kept for the version."""
        if not self.delta.enable_delta_weight_update:
            super()._update_bucket_weights_from_distributed(meta, converted_named_tensors)
            return
        assert self._buckets is not None, "AReaL hands buckets to the pipeline head only"
        self._buckets.add(converted_named_tensors, version=meta.version)
        converted_named_tensors.clear()
