"""AReaL 1.0.4's v2 actor controller, with weight updates that fail loudly and retry in full.

AReaL's ``GatewayTrainController.update_weights`` asks its weight-update gateway for a
version and only logs the result, so ``PPOTrainer`` records (``set_version``) a version a
rollout refused as if it had arrived; and the gateway keeps only the HTTP status of the
refusal, not its text. `DeltaActorControllerV2` instead:

1. connects through `DeltaWeightUpdateController`, which runs AReaL's gateway with the
   refusal text kept (`weight_gateway`) and raises `WeightUpdateRefusedError` carrying it
   when an update fails;
2. on a refusal logs the text, asks every train worker to send that version in full
   (AReaL's ``/configure`` route, `full_sync_request`) and asks for the version once more;
3. raises when that fails too, so no ``set_version`` follows.

Generation is paused around the update and resumed in every case, as AReaL does. The
warning with the refusal text goes to AReaL's logger, so it reaches the trainer's console
and its log files (``setup_file_logging``).
`areal_trainer.DeltaPPOTrainer` builds this controller for the actor when the delta path is
on. The AReaL names it relies on are checked when it is built (`check_controller`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
from typing import Any

from ..areal_import import areal_module
from .compat import check_uses
from ..errors import WeightUpdateRefusedError
from .weight_gateway import GATEWAY_APP, check_gateway

__all__ = ["DeltaActorControllerV2", "DeltaWeightUpdateController", "check_controller"]

# AReaL's own logger: AReaL's getLogger replaces logging's root on every call, so a plain
# logger created before it logs nowhere; this one gets the trainer's handlers and log files.
log = areal_module("areal.utils.logging").getLogger("DeltaActorControllerV2")
_actor = areal_module("areal.trainer.ppo.actor")
_train_ctrl = areal_module("areal.experimental.training_service.controller.controller")
_update_ctrl = areal_module("areal.experimental.weight_update.controller.controller")
OK = "ok"
"""The gateway's status of a delivered update."""
GATEWAY = "areal_dte.areal.weight_gateway"
"""The module the weight-update gateway runs from (AReaL's gateway, refusal text kept)."""
GATEWAY_START_S = 300.0
"""How long the gateway may take to answer: it imports AReaL (torch with it), which took
46 s on a loaded 2-core machine here, above the 30 s AReaL's controller waits by default."""
FULL_SYNC_ROUTE = "/configure"
"""AReaL's train-worker route that calls the engine's ``configure``."""


def check_controller() -> None:
    """Check the AReaL 1.0.4 names the two controllers below and `weight_gateway` rely on.

    Raises:
        IncompatibleStackError: another AReaL release, or code that no longer uses them.
    """
    gateway_ctrl = _train_ctrl.GatewayTrainController
    update_ctrl = _update_ctrl.WeightUpdateController
    check_uses("GatewayTrainController.connect_engine", gateway_ctrl.connect_engine.__code__,
               ["WeightUpdateController", "_weight_update_ctrl", "_worker_addrs"])
    call = getattr(gateway_ctrl, "_call_worker_engine_endpoint", None)
    check_uses("GatewayTrainController._call_worker_engine_endpoint",
               getattr(call, "__code__", None), ["post"])
    check_uses("WeightUpdateController.initialize", update_ctrl.initialize.__code__,
               ["_gateway_proc", "_gateway_url", "_session", "_wait_for_health"])
    check_gateway(areal_module(GATEWAY_APP))


class DeltaWeightUpdateController(_update_ctrl.WeightUpdateController):
    """AReaL's ``WeightUpdateController`` on a gateway that keeps refusal texts, raising
    `WeightUpdateRefusedError` for a failed update instead of returning it."""

    def initialize(self) -> None:
        """Start the gateway from `GATEWAY` (AReaL's own start, another module), waiting
        at least `GATEWAY_START_S` for it to answer."""
        cfg = self.config = dataclasses.replace(
            self.config, setup_timeout=max(self.config.setup_timeout, GATEWAY_START_S))
        port = cfg.port or areal_module("areal.utils.network").find_free_ports(1)[0]
        command = [sys.executable, "-m", GATEWAY, "--host", cfg.host, "--port", str(port),
                   "--admin-api-key", cfg.admin_api_key, "--init-timeout", str(cfg.init_timeout_s),
                   "--update-timeout", str(cfg.update_timeout_s), "--log-level", cfg.log_level]
        self._gateway_proc = subprocess.Popen(command, stdout=sys.stdout, stderr=sys.stdout)
        self._gateway_url = f"http://{cfg.host}:{port}"
        self._session = areal_module("httpx").Client(
            headers={"Authorization": f"Bearer {cfg.admin_api_key}"})
        self._wait_for_health()

    def update_weights(self, version: int) -> Any:
        """AReaL's update of ``version`` through the gateway.

        Raises:
            WeightUpdateRefusedError: a worker failed it; ``detail`` is what it answered.
        """
        result = super().update_weights(version)
        if result.status != OK:
            raise WeightUpdateRefusedError(version, detail=str(result.error))
        return result


class DeltaActorControllerV2(_actor.PPOActorControllerV2):
    """AReaL's v2 PPO actor controller whose weight updates raise on failure (see the
    module docstring); arguments as AReaL's.

    Raises:
        IncompatibleStackError: at construction, an AReaL other than the pinned release.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        check_controller()
        super().__init__(*args, **kwargs)

    def connect_engine(self, rollout: Any, meta: Any) -> None:
        """AReaL's connection, its weight updates through `DeltaWeightUpdateController`."""
        # AReaL's connect_engine imports the class from its module when it runs.
        areal_class = _update_ctrl.WeightUpdateController
        _update_ctrl.WeightUpdateController = DeltaWeightUpdateController
        try:
            super().connect_engine(rollout, meta)
        finally:
            _update_ctrl.WeightUpdateController = areal_class

    def update_weights(self, meta: Any) -> None:
        """Deliver ``meta.version``; after a refusal, once more in full.

        Raises:
            WeightUpdateRefusedError: the full resend failed too (its text in ``detail``).
        """
        if self._weight_update_ctrl is None or self.rollout is None:
            super().update_weights(meta)  # AReaL's error for a controller not connected
            return
        version = meta.version
        self.rollout.pause_generation()
        try:
            try:
                result = self._weight_update_ctrl.update_weights(version)
            except WeightUpdateRefusedError as refused:
                log.warning("v%d refused: %s; sending v%d again, in full", version,
                            refused.detail, version)
                self._request_full_sync(version, reason=refused.detail)
                result = self._weight_update_ctrl.update_weights(version)
        finally:
            self.rollout.continue_generation()
        log.info("v%d weight update delivered (%.0f ms)", version, result.duration_ms)

    def _request_full_sync(self, version: int, *, reason: str) -> None:
        kwargs = {"full_sync_version": version, "reason": reason}

        async def configure_all() -> None:
            await asyncio.gather(*[
                self._call_worker_engine_endpoint(address, FULL_SYNC_ROUTE, kwargs=kwargs,
                                                  timeout=self.config.request_timeout)
                for address in self._worker_addrs])

        areal_module("areal.infra.utils.concurrent").run_async_task(configure_all)
