"""The exact AReaL stack cluster mode installs itself into, checked before it does.

Cluster mode replaces two of AReaL 1.0.4's awex adapters through module attributes that
AReaL resolves at call time, and builds its weight-update group with a private torch
helper. None of these is a public API, so each process checks, before installing
anything, the versions it was written against and that each name still exists and is
still resolved the way the install relies on. A mismatch is an `IncompatibleStackError`
naming the version or the name.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable, Sequence
from importlib.metadata import PackageNotFoundError, version
from types import CodeType

import attrs

from ..errors import IncompatibleStackError

__all__ = ["AREAL", "MEGATRON_ADAPTER", "ROLLOUT_PINS", "SGLANG_ADAPTER", "TRAINER_PINS", "Pin",
           "check_pins", "check_rollout", "check_trainer", "check_uses", "nested_code"]


@attrs.frozen
class Pin:
    """A distribution and the versions of it that cluster mode was checked against."""

    distribution: str
    versions: tuple[str, ...] = attrs.field(converter=tuple)


AREAL = Pin("areal", ("1.0.4",))
AWEX = Pin("awex", ("0.7.0",))
SGLANG = Pin("sglang", ("0.5.10.post1",))
MEGATRON = Pin("megatron-core", ("0.16.1", "0.17.0"))
"""0.16.1 is the newest for Python 3.11 (the CPU tests); AReaL 1.0.4's extra pins 0.17.0."""
TRAINER_PINS = (AREAL, AWEX, MEGATRON)
ROLLOUT_PINS = (AREAL, AWEX, SGLANG)

MEGATRON_ADAPTER = ("areal.experimental.weight_update.awex.megatron_adapter",
                    "AwexMegatronAdapter")
"""The module attribute AReaL's train worker resolves when it builds its awex adapter."""
SGLANG_ADAPTER = ("areal.experimental.weight_update.awex.sglang_adapter", "AwexSGLangAdapter")
"""The module attribute AReaL's SGLang scheduler bridge resolves for its awex adapter."""
_TRAIN_WORKER = ("areal.experimental.training_service.worker.awex", "_create_training_adapter")
_SCHEDULER_BRIDGE = ("areal.experimental.inference_service.sglang.scheduler",
                     "AwexSchedulerBridge")


def check_pins(pins: Sequence[Pin]) -> None:
    """Raise `IncompatibleStackError` unless every pinned distribution is installed at
    one of its versions."""
    for pin in pins:
        try:
            got = version(pin.distribution)
        except PackageNotFoundError:
            got = "not installed"
        if got not in pin.versions:
            raise IncompatibleStackError(f"{pin.distribution} version",
                                         expected=" or ".join(pin.versions), got=got)


def check_trainer() -> None:
    """Pins, then the names a train worker's install relies on.

    Raises:
        IncompatibleStackError: a version or a name differs.
    """
    check_pins(TRAINER_PINS)
    _resolved_at_call_time(_TRAIN_WORKER, MEGATRON_ADAPTER)
    _check_group_helper()


def check_rollout() -> None:
    """Pins, then the names an SGLang scheduler's install relies on.

    Raises:
        IncompatibleStackError: a version or a name differs.
    """
    check_pins(ROLLOUT_PINS)
    bridge = _attribute(_SCHEDULER_BRIDGE)
    _resolved_at_call_time((_SCHEDULER_BRIDGE[0], f"{_SCHEDULER_BRIDGE[1]}._require_adapter"),
                           SGLANG_ADAPTER, function=bridge._require_adapter)
    scheduler = _attribute(("sglang.srt.managers.scheduler", "Scheduler"))
    if not callable(getattr(scheduler, "flush_cache", None)):
        raise IncompatibleStackError("sglang Scheduler.flush_cache", expected="a method",
                                     got="missing")


def _attribute(where: tuple[str, str]):
    module, name = where
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise IncompatibleStackError(f"{module}.{name}", expected="present",
                                     got=f"{type(exc).__name__}: {exc}") from exc


def _resolved_at_call_time(caller: tuple[str, str], target: tuple[str, str], *,
                           function=None) -> None:
    """The install swaps ``target``'s module attribute; that reaches ``caller`` only if
    it still imports the name from that module when called."""
    function = function or _attribute(caller)
    code = getattr(function, "__code__", None)
    names = set(code.co_names) if code is not None else set()
    if not {target[0], target[1]} <= names:
        raise IncompatibleStackError(f"{'.'.join(caller)}", expected=(
            f"an import of {target[0]}.{target[1]} at call time"), got=sorted(names))
    _attribute(target)


def _check_group_helper() -> None:
    from torch.distributed import distributed_c10d

    helper = getattr(distributed_c10d, "_new_process_group_helper", None)
    params = inspect.signature(helper).parameters if helper is not None else {}
    if "backend_options" not in params or not hasattr(distributed_c10d, "_world"):
        raise IncompatibleStackError(
            "torch.distributed.distributed_c10d._new_process_group_helper",
            expected="a backend_options parameter and _world", got=sorted(params))


def check_uses(where: str, code: CodeType | None, names: Iterable[str]) -> None:
    """The pinned AReaL, and ``code`` (the code object at ``where``, with the functions
    and comprehensions inside it) still using every one of ``names``: where cluster mode
    wraps a name that AReaL looks up at call time.

    Raises:
        IncompatibleStackError: another AReaL, no such code, or a name it no longer uses.
    """
    check_pins((AREAL,))
    missing = sorted(set(names) - (_names(code) if code is not None else set()))
    if missing:
        raise IncompatibleStackError(where, expected=f"code that uses {', '.join(missing)}",
                                     got="code without them")


def _names(code: CodeType) -> set[str]:
    inner = (const for const in code.co_consts if isinstance(const, CodeType))
    return set(code.co_names).union(*(_names(c) for c in inner))


def nested_code(code: CodeType, name: str) -> CodeType | None:
    """The code object of the function ``name`` defined directly inside ``code``."""
    return next((const for const in code.co_consts
                 if isinstance(const, CodeType) and const.co_name == name), None)
