"""The rollout side inside an SGLang server: DTE payloads applied into the live model.

A payload (the bytes of ``dte_codec.encode_full`` / ``encode_delta``, tensors under
their Hugging Face names) travels through SGLang's own weight-update requests as one
uint8 tensor named ``PAYLOAD_TENSOR`` (``payload_tensors``): over the weight-update
group with ``update_weights_from_distributed``, or with ``update_weights_from_tensor``.
Both end in the model's ``load_weights`` on every TP worker, where areal-dte's SGLang
plugin (``sglang_plugin``) hands it to ``load_payload``. ``load_payload`` keeps one
``SGLangReceiver`` per live model across calls: a ``dte_transport.Receiver`` (stream,
version chain, all-or-nothing writes) whose stage is a ``ShardStage`` from the Hugging
Face layout into this rank's fused params (``dte_codec.sglang_layout``). A refused
payload raises ``PayloadRejectedError`` and changes nothing; SGLang answers the request
with ``success=False`` and the reason.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence

import attrs
import torch
from dte_codec.errors import GeometryError
from dte_codec.layouts import EMBED, ModelConfig, hf_shard
from dte_codec.sglang_layout import SGLangLayout, sglang_shard
from dte_transport import Ack, Receiver, Rejection

from .errors import MissingExtraError, PayloadRejectedError, UnsupportedModelError
from .shard_stage import ShardStage

log = logging.getLogger(__name__)

PAYLOAD_TENSOR = "dte.payload"
"""The name of the one tensor of a weight update that carries a payload (uint8 bytes)."""

_RECEIVERS: weakref.WeakKeyDictionary[torch.nn.Module, SGLangReceiver] = (
    weakref.WeakKeyDictionary())
"""Receiver state per live model, kept across calls; it goes with the model."""


def payload_tensors(data: bytes | bytearray | memoryview) -> list[tuple[str, torch.Tensor]]:
    """The named tensors that carry one payload through a weight-update request."""
    return [(PAYLOAD_TENSOR, torch.frombuffer(bytearray(data), dtype=torch.uint8))]


@attrs.frozen
class SGLangReceiver:
    """One SGLang model's live parameters at one version of one stream.

    Build it with ``SGLangReceiver.of``; ``receiver`` holds the version chain.
    """

    receiver: Receiver
    layout: SGLangLayout
    rank: int

    @classmethod
    def of(cls, model: torch.nn.Module, *, layout: SGLangLayout, rank: int) -> SGLangReceiver:
        """The receiver of ``model`` (a Qwen3ForCausalLM or Qwen3MoeForCausalLM of SGLang),
        TP rank ``rank`` of ``layout``, holding no version yet.

        Raises:
            UnsupportedModelError: the model's config or params do not fit the layout.
        """
        params = dict(model.named_parameters())
        try:
            config = ModelConfig.from_hf(model.config, dtype=params[EMBED].dtype)
            stage = ShardStage.of(hf_shard(config), sglang_shard(config, layout, rank=rank),
                                  params)
        except GeometryError as exc:
            field = exc.field if exc.tensor is None else f"tensor {exc.tensor!r}: {exc.field}"
            raise UnsupportedModelError(field, expected=exc.expected, got=exc.got) from exc
        receiver = Receiver(params, device=params[EMBED].device, stage=stage)
        return cls(receiver=receiver, layout=layout, rank=rank)

    @property
    def version(self) -> int | None:
        return self.receiver.version

    @property
    def stream_id(self) -> str | None:
        return self.receiver.stream_id

    def receive(self, data: bytes | bytearray | memoryview) -> Ack:
        """Decode, check and apply one payload into the live params, all or nothing.

        Raises:
            PayloadRejectedError: refused (corrupt bytes, another stream, a delta onto
                another base, tensors that do not fit, a failed write); the params and the
                version are as before, except after a failed full write (no version).
        """
        start = time.perf_counter()
        ack = self.receiver.receive(data)
        if not ack.accepted:
            raise PayloadRejectedError(ack)
        log.info("tp rank %d: v%d of %s applied, %d B, %.1f ms", self.rank, ack.version,
                 self.stream_id, len(data), (time.perf_counter() - start) * 1e3)
        return ack


def load_payload(model: torch.nn.Module,
                 named_tensors: Sequence[tuple[str, torch.Tensor]]) -> Ack:
    """Apply the payload in ``named_tensors`` into ``model``, a TP worker's live model.

    Args:
        model: the worker's SGLang model; its receiver state lives as long as it does.
        named_tensors: ``payload_tensors(data)`` as the worker received it.

    Returns:
        The receiver's ack.

    Raises:
        UnsupportedModelError: the first payload for a model that the layouts do not fit.
        PayloadRejectedError: the payload was refused; nothing changed.
    """
    receiver = _RECEIVERS.get(model)
    if receiver is None:
        layout, rank = parallel_layout()
        receiver = _RECEIVERS[model] = SGLangReceiver.of(model, layout=layout, rank=rank)
    names = [(name, tuple(t.shape), t.dtype) for name, t in named_tensors]
    if len(names) != 1 or names[0][0] != PAYLOAD_TENSOR or names[0][2] != torch.uint8:
        raise PayloadRejectedError(Ack(
            accepted=False, version=receiver.version, rejection=Rejection.BAD_PAYLOAD,
            detail=f"expected one uint8 tensor {PAYLOAD_TENSOR!r}, got {names}"))
    # decode parses the header on the host; the body goes back to the params' device
    tensor = named_tensors[0][1].detach().reshape(-1).cpu()
    return receiver.receive(memoryview(tensor.numpy()))


def parallel_layout() -> tuple[SGLangLayout, int]:
    """This worker's layout and TP rank, from SGLang's published parallel config.

    Raises:
        MissingExtraError: sglang is not installed.
        UnsupportedModelError: pipeline parallel, attention DP/CP or MoE DP, which the
            SGLang layout does not describe.
    """
    try:
        from sglang.srt.runtime_context import get_parallel
    except ImportError as exc:
        raise MissingExtraError("sglang", extra="sglang") from exc
    parallel = get_parallel()
    for field in ("pp_size", "moe_dp_size"):
        if getattr(parallel, field) != 1:
            raise UnsupportedModelError(f"sglang {field}", expected=1,
                                        got=getattr(parallel, field))
    if parallel.attn_tp_size != parallel.tp_size:
        raise UnsupportedModelError("sglang attn_tp_size", got=parallel.attn_tp_size,
                                    expected=f"tp_size {parallel.tp_size} (no attention DP/CP)")
    return SGLangLayout(tp=parallel.tp_size, ep=parallel.moe_ep_size), parallel.tp_rank
