"""AReaL 1.0.4's weight-update gateway, with a worker's refusal text kept.

AReaL's gateway (``areal.experimental.weight_update.gateway``, a process of its own that
AReaL's ``WeightUpdateController`` starts) posts ``/awex/update_weights`` to every train
and rollout worker through its module-level ``_post``. That helper retries any failure up to
8 times over about 90 s (``async_http_retry``) and raises ``raise_for_status()``'s error,
which holds the status and reason but not the answer's body. Re-posting a weight update to
one worker starts a collective the other workers have left, and dropping the body loses
the rollout's reason for refusing. So for that one request `keep_refusals` makes ``_post``
ask once and turn a status >= 400 into `WorkerAnswerError` carrying the body; the gateway
reports it as the update's ``error`` (HTTP 200, ``status: "error"``). Every other request
keeps AReaL's ``_post``.

Run as ``python -m areal_dte.areal.weight_gateway`` with the arguments of AReaL's gateway
(`controller_v2.DeltaWeightUpdateController` starts it so).
"""

from __future__ import annotations

import types
from typing import Any

from ..areal_import import areal_module
from .compat import check_uses, nested_code
from ..errors import WorkerAnswerError

__all__ = ["GATEWAY_APP", "UPDATE_PATH", "check_gateway", "keep_refusals"]

GATEWAY_APP = "areal.experimental.weight_update.gateway.app"
"""AReaL's weight-update gateway app module, whose ``_post`` `keep_refusals` replaces."""
UPDATE_PATH = "/awex/update_weights"
"""The worker route of one weight update, as AReaL's gateway posts it."""
_TRANSFER = "_awex_transfer_weights"
"""The gateway's closure that posts `UPDATE_PATH` through ``_post``."""


def check_gateway(app: types.ModuleType) -> None:
    """Check that AReaL's gateway posts weight updates through ``app._post`` as 1.0.4 does.

    Raises:
        IncompatibleStackError: another AReaL release, or one whose gateway posts otherwise.
    """
    check_uses(f"{GATEWAY_APP}.create_app.{_TRANSFER}",
               nested_code(app.create_app.__code__, _TRANSFER), ["_post"])


def keep_refusals(app: types.ModuleType) -> None:
    """Replace ``app._post`` so a weight update is asked once and its refusal text kept.

    Raises:
        IncompatibleStackError: `check_gateway` fails.
    """
    check_gateway(app)
    aiohttp = areal_module("aiohttp")
    areal_post = app._post

    async def _post(session: Any, url: str, timeout_s: float, json_data: Any = None) -> None:
        if not url.endswith(UPDATE_PATH):
            return await areal_post(session, url, timeout_s, json_data)
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.post(url, json=json_data, timeout=timeout) as resp:
            if resp.status >= 400:
                raise WorkerAnswerError(url, status=resp.status, text=await resp.text())
        return None

    app._post = _post


def main() -> None:
    """AReaL's gateway command line, on an app whose weight updates keep refusals."""
    keep_refusals(areal_module(GATEWAY_APP))
    areal_module("areal.experimental.weight_update.gateway.__main__").main()


if __name__ == "__main__":
    main()
