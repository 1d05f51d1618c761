"""The one error hierarchy of areal-dte.

Errors of the packages it composes (``dte_codec``, ``dte_transport``, ``dte_detector``)
pass through unchanged; these are the ones the integration itself raises.
"""

from __future__ import annotations

from dte_config import ConfigValidationError
from dte_transport import Ack


class ArealDteError(Exception):
    """Root of every error raised by areal-dte."""


class MissedChangeError(ArealDteError, ValueError):
    """Snapshot verification: a detector missed a changed element of ``tensor``, or gave
    old-value bounds that exclude the value the receiver holds."""

    def __init__(self, tensor: str, *, missed: int, outside: int, example: int):
        self.tensor, self.missed, self.outside, self.example = tensor, missed, outside, example
        super().__init__(f"tensor {tensor!r}: {missed} changed elements missed, {outside} "
                         f"old values outside their bounds (e.g. element {example})")


class UnknownParameterError(ArealDteError, ValueError):
    """The optimizer holds a parameter the actor was not given as a master, so its
    changes would never reach the rollout (e.g. one added with ``add_param_group``)."""

    def __init__(self, shape: tuple[int, ...], dtype: object):
        self.shape, self.dtype = shape, dtype
        super().__init__(f"the optimizer holds a parameter of shape {shape} and dtype {dtype} "
                         "that is not among the actor's masters; pass every optimizer "
                         "parameter in masters= (build a new actor after add_param_group)")


class MissingExtraError(ArealDteError, ImportError):
    """An adapter needs an optional package that is not installed."""

    def __init__(self, package: str, *, extra: str):
        self.package, self.extra = package, extra
        super().__init__(f"{package} is not installed; install it with `uv sync --extra {extra}` "
                         f"(or `pip install 'exact-delta-sync[{extra}]'`)")


class UnsupportedModelError(ArealDteError, ValueError):
    """A rollout model or parallel setup that the receiver's layouts do not describe."""

    def __init__(self, field: str, *, expected: object, got: object):
        self.field, self.expected, self.got = field, expected, got
        super().__init__(f"{field}: expected {expected}, got {got}")


REFUSAL = "payload rejected"
"""How every `PayloadRejectedError` message starts; a sender that sees only the rollout's
text (SGLang's failure answer) tells the receiver's refusals from other failures by it."""


class PayloadRejectedError(ArealDteError, ValueError):
    """A receiver refused a payload; it holds ``ack.version`` as before (except after
    a failed full write, where it holds none)."""

    def __init__(self, ack: Ack):
        self.ack = ack
        super().__init__(f"{REFUSAL} ({ack.rejection.value}): {ack.detail}; "
                         f"holding version {ack.version}")


class AReaLImportError(ArealDteError, ImportError):
    """An AReaL module (or what it imports, such as AReaL's Megatron stack) cannot be
    imported; ``cause`` is the original error's message."""

    def __init__(self, module: str, *, cause: str):
        self.module, self.cause = module, cause
        super().__init__(f"{module} cannot be imported ({cause}); the AReaL cluster mode "
                         "needs AReaL 1.0.4 (`uv sync --extra areal`), and its Megatron actor "
                         "also areal[megatron] (megatron-core 0.17.0, megatron-bridge 0.4.0, "
                         "mbridge 0.15.1; Python >= 3.12): see packages/areal-dte/README.md")

    def __reduce__(self):
        return _rebuild_import_error, (self.module, self.cause)


def _rebuild_import_error(module: str, cause: str) -> AReaLImportError:
    return AReaLImportError(module, cause=cause)


class ClusterModeError(ArealDteError, ConfigValidationError):
    """A setting the AReaL cluster mode cannot run; names the key, the value and the fix.

    It is a ``dte_config.ConfigValidationError`` too, so whoever reports rejected settings
    reports this one the same way.
    """

    def __reduce__(self):
        return _rebuild_cluster_error, (self.key, self.value, self.problem, self.fix)


def _rebuild_cluster_error(key: str, value: object, problem: str, fix: str) -> ClusterModeError:
    return ClusterModeError(key=key, value=value, problem=problem, fix=fix)


class DeltaSyncError(ArealDteError, RuntimeError):
    """The actor's delta path met a weight update it cannot serve (``field``: what it got,
    ``expected``: what it needs)."""

    def __init__(self, field: str, *, expected: object, got: object):
        self.field, self.expected, self.got = field, expected, got
        super().__init__(f"{field}: expected {expected}, got {got}")


class WeightUpdateRefusedError(ArealDteError, RuntimeError):
    """A weight update of ``version`` failed on a worker; ``detail`` is what the worker
    answered (a rollout's refusal text, through the weight-update gateway)."""

    def __init__(self, version: int, *, detail: str):
        self.version, self.detail = version, detail
        super().__init__(f"v{version}: weight update failed: {detail}")


class WorkerAnswerError(ArealDteError, RuntimeError):
    """A worker answered a weight-update request with an HTTP error; ``text`` is its body."""

    def __init__(self, url: str, *, status: int, text: str):
        self.url, self.status, self.text = url, status, text
        super().__init__(f"{url} answered {status}: {text}")


class IncompatibleStackError(ArealDteError, RuntimeError):
    """The installed AReaL/awex/SGLang/megatron-core/torch differ from what cluster mode
    hooks into (``what``: a distribution's version or a private name it relies on)."""

    def __init__(self, what: str, *, expected: object, got: object):
        self.what, self.expected, self.got = what, expected, got
        super().__init__(f"{what}: expected {expected}, got {got}; cluster mode installs "
                         "itself into these exact versions (packages/areal-dte/README.md)")

    def __reduce__(self):
        return _rebuild_stack_error, (self.what, self.expected, self.got)


def _rebuild_stack_error(what: str, expected: object, got: object) -> IncompatibleStackError:
    return IncompatibleStackError(what, expected=expected, got=got)
