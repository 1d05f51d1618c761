"""Where each fp32 main shard of a megatron-core optimizer sits in its bf16 model param.

Megatron's ``DistributedOptimizer`` gives every data-parallel rank a contiguous range of
each model param's flattened elements: ``shard_fp32_from_float16_groups`` holds the fp32
main copy of that range, ``model_float16_groups`` the param at the same position, and
``_get_model_param_range_map(param)["param"]`` the range. The non-distributed mixed-
precision optimizer (``Float16OptimizerWithFloat16Params``) keeps whole params
(``fp32_from_float16_groups``). The names come from the model (wrappers' ``module.``
prefixes stripped), so they are those of a bare ``GPTModel`` (``dte_codec.megatron_layout``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import attrs
import torch

from ..errors import UnsupportedModelError

TESTED = ("0.16.1", "0.17.0")
"""megatron-core versions whose optimizer structures this module was checked against on a
GPU (tools/gpu/check_megatron.py); others are attached if the structures are there."""
_DISTRIBUTED = ("shard_fp32_from_float16_groups", "model_float16_groups", "shard_fp32_groups",
                "model_fp32_groups", "_get_model_param_range_map",
                "_copy_main_params_to_model_params", "optimizer")
_PAYLOAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Model param dtypes the detectors compare bit for bit (fp8 params are refused)."""
_MIXED = ("fp32_from_float16_groups", "float16_groups", "fp32_from_fp32_groups",
          "_copy_main_params_to_model_params", "optimizer")


@attrs.frozen(eq=False)
class MainShard:
    """One fp32 main shard and the part of its model param that it is the master of."""

    name: str
    main: torch.Tensor
    """The fp32 master of the range (what the inner torch optimizer steps)."""
    param: torch.Tensor
    """The whole model param (bf16, or fp32 for params kept in fp32)."""
    start: int
    """Offset of the range in the param's flattened elements."""

    @property
    def model(self) -> torch.Tensor:
        """The model param's elements of this range, flat (a view: writes reach the param).

        Through ``.data``, as Megatron's own copy writes: such writes leave the param's
        version counter alone, so the counter moves only for writes through the param
        itself (a checkpoint loaded into the model), which the detector watches.
        """
        return self.param.data.view(-1)[self.start:self.start + self.main.numel()]


def inner_optimizers(optimizer: object) -> list[object]:
    """The optimizers of a ``ChainedOptimizer`` (dense and expert params), or ``[optimizer]``."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def named_params(model: torch.nn.Module | Sequence[torch.nn.Module]
                 ) -> dict[str, torch.nn.Parameter]:
    """Every param of the model chunks by name, ``module.`` prefixes stripped."""
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    named = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            while name.startswith("module."):
                name = name[len("module."):]
            named[name] = param
    return named


def param_names(model: torch.nn.Module | Sequence[torch.nn.Module]) -> dict[int, str]:
    """``id(param) -> name`` over the model chunks, ``module.`` prefixes stripped."""
    return {id(param): name for name, param in named_params(model).items()}


def main_shards(inner: object, names: dict[int, str]) -> Iterator[MainShard]:
    """Every (main shard, model param range) of one inner megatron-core optimizer.

    Raises:
        UnsupportedModelError: an optimizer without the structures of the tested
            megatron-core versions, or a param that is not in the model.
    """
    distributed = hasattr(inner, "shard_fp32_from_float16_groups")
    needed = _DISTRIBUTED if distributed else _MIXED
    missing = [a for a in needed if not hasattr(inner, a)]
    if missing:
        raise UnsupportedModelError(
            f"{type(inner).__name__} attributes", expected=f"those of megatron-core {TESTED}",
            got=f"missing {missing} (megatron-core {_version()})")
    if not distributed and any(inner.fp32_from_fp32_groups):
        # Stepped in place with no copy to hook: neither detector would see them.
        raise UnsupportedModelError("fp32 model params", expected="none with the "
                                    "non-distributed optimizer", got="some (e.g. the router)")
    pairs = ((inner.shard_fp32_from_float16_groups, inner.model_float16_groups),
             (inner.shard_fp32_groups, inner.model_fp32_groups)) if distributed else (
        (inner.fp32_from_float16_groups, inner.float16_groups),)
    for main_groups, model_groups in pairs:
        for main_group, model_group in zip(main_groups, model_groups):
            for main, param in zip(main_group, model_group):
                if id(param) not in names:
                    raise UnsupportedModelError("optimizer param", expected="a param of the model",
                                                got=f"one of shape {tuple(param.shape)}")
                if param.dtype not in _PAYLOAD_DTYPES:
                    raise UnsupportedModelError(f"param {names[id(param)]!r} dtype",
                                                expected=_PAYLOAD_DTYPES, got=param.dtype)
                start = inner._get_model_param_range_map(param)["param"].start if distributed else 0
                yield MainShard(names[id(param)], main, param, start)


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("megatron-core")
    except Exception:  # noqa: BLE001 - only for the message
        return "unknown"
