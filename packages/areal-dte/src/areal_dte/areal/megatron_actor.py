"""AReaL's Megatron PPO actor, its weight updates sent through the delta path.

AReaL's train workers build this class from its import path (``areal_job.DELTA_ACTOR``),
so importing this module imports AReaL's Megatron engine (`AReaLImportError` when that
stack is missing). The engine reads the ``DTE_*`` variables when it is built, the worker's
start, and holds them to what cluster mode runs (`cluster_rules.check_delta`). With
``DTE_ENABLE_DELTA_WEIGHT_UPDATE=0`` it is AReaL's engine unchanged.

With the path on it installs `awex_megatron.DeltaAwexMegatronAdapter` (after the stack
checks of `compat`) where AReaL's train worker looks its awex adapter up; the worker
builds that adapter at the first ``/awex/*`` call, after this constructor. AReaL's v2
weight update then runs as AReaL runs it (the gateway pauses generation, every train and
rollout rank executes the update over the awex group, generation resumes), each rank
sending its own changes.

Its ``configure`` (`FullSyncRequests`, AReaL's train-worker ``/configure`` route) records
`controller_v2.DeltaActorControllerV2`'s request to send a refused version in full; the
adapter takes it (``take_full_sync_request``) when it sends that version.
"""

from __future__ import annotations

import os
from typing import Any

from dte_config import read_env

from ..areal_import import areal_module
from .cluster_rules import check_delta
from .full_sync_request import FullSyncRequests

__all__ = ["DeltaMegatronPPOActor"]

_engine = areal_module("areal.engine.megatron_engine")


class DeltaMegatronPPOActor(FullSyncRequests, _engine.MegatronPPOActor):
    """``MegatronPPOActor`` whose awex weight updates send deltas (see the module docstring).

    Raises:
        ClusterModeError: at construction, ``DTE_*`` settings cluster mode cannot run.
        dte_config.ConfigValidationError: at construction, unparsable ``DTE_*`` variables.
        IncompatibleStackError: at construction with the path on, an AReaL/awex/
            megatron-core/torch other than the ones the install was written for.
    """

    def __init__(self, config: Any):
        super().__init__(config)
        self.delta = read_env(os.environ)
        check_delta(self.delta)
        if self.delta.enable_delta_weight_update:
            from .awex_megatron import install

            install()
