"""areal-dte's SGLang general plugin: weight updates that carry a DTE payload reach it.

Registered as the entry point ``areal_dte = "areal_dte.sglang_plugin:register"`` of the
group ``sglang.srt.plugins``, which SGLang loads in every process it starts, it adds two
hooks through SGLang's ``HookRegistry``:

- around ``load_weights`` of SGLang's Qwen3 and Qwen3-MoE models, where every weight
  update ends on every TP worker: a list holding just the payload tensor
  (``sglang_receiver.payload_tensors``) goes to ``sglang_receiver.load_payload``;
  anything else (a checkpoint, ordinary tensors) to SGLang's own loader;
- around the model runner's ``WeightUpdater.update_weights_from_tensor``: sglang 0.5.23
  does not catch what a load raises there, so a refused payload would end the scheduler
  process; the hook answers ``(False, reason)`` instead, as SGLang itself does for
  ``update_weights_from_distributed``. SGLang then skips the weight-version record and
  the cache flush, and the request returns ``success=False`` with the reason.
"""

from __future__ import annotations

import logging

from .errors import ArealDteError, MissingExtraError
from .sglang_receiver import PAYLOAD_TENSOR, load_payload

log = logging.getLogger(__name__)

PLUGIN = "areal_dte"
"""The plugin's entry-point name (what ``SGLANG_PLUGINS`` would list)."""
MODELS = ("sglang.srt.models.qwen3.Qwen3ForCausalLM.load_weights",
          "sglang.srt.models.qwen3_moe.Qwen3MoeForCausalLM.load_weights")
"""The loaders that route payloads: the models whose layouts ``dte_codec`` describes."""
TENSOR_UPDATE = ("sglang.srt.model_executor.model_runner_components.weight_updater."
                 "WeightUpdater.update_weights_from_tensor")


def register() -> None:
    """Register the hooks; SGLang applies them right after it loads its plugins.

    Raises:
        MissingExtraError: sglang is not installed.
    """
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except ImportError as exc:
        raise MissingExtraError("sglang", extra="sglang") from exc
    for target in MODELS:
        HookRegistry.register(target, route_payloads, HookType.AROUND)
    HookRegistry.register(TENSOR_UPDATE, answer_refusals, HookType.AROUND)


def route_payloads(original, model, weights, *args, **kwargs):
    """The hook around a model's ``load_weights``."""
    # A checkpoint arrives as an iterator, which must not be consumed here; a payload
    # always comes as the list that a weight-update request builds.
    if (isinstance(weights, (list, tuple)) and len(weights) == 1
            and weights[0][0] == PAYLOAD_TENSOR):
        load_payload(model, weights)
        return None
    return original(model, weights, *args, **kwargs)


def answer_refusals(original, *args, **kwargs):
    """The hook around ``update_weights_from_tensor``: SGLang's ``(success, message)``
    answer, with an areal-dte error (a refused payload, an unsupported model) as
    ``(False, reason)``."""
    try:
        return original(*args, **kwargs)
    except ArealDteError as exc:
        log.warning("DTE weight update failed: %s", exc)
        return False, f"DTE weight update failed: {exc}"
