"""Exact change sets inside a megatron-core optimizer: cast dirty bits or AdamW inversion.

``attach(optimizer, model, method=...)`` hooks every inner optimizer of a megatron-core
``DistributedOptimizer`` (or ``ChainedOptimizer`` of them, or the non-distributed
mixed-precision optimizer) at instance level, copying no Megatron code:

- ``Method.CAST`` replaces ``_copy_main_params_to_model_params`` with the same copies
  of every fp32 main shard into its bf16 model param range, each fused with the compare
  of the cast against the current bf16 values (``CastDetector.record_and_copy_all``: one
  batched Triton pass over every shard on CUDA); dirty bits accumulate over any number of
  steps until ``commit``;
- ``Method.ADAMW`` registers step hooks on the inner torch optimizer (public
  ``register_step_pre_hook``/``register_step_post_hook``): each main shard's state is
  recorded when its step count moved, with the lr, betas and weight decay of that step;
  ``collect`` inverts one step per shard, all shards together
  (``dte_detector.invert_adamw_all``).

Both give, per model param of this rank (a Megatron TP/PP/EP shard), flat indices into
the param. The contract is the torch actor's: what a detector cannot vouch for sets
``full_reason`` (the first sync after attaching, ``reload_model_params``, a loaded
optimizer state, a model param written outside Megatron's copy (version counters: e.g.
``load_state_dict`` of the model), a step gap for ``adamw``); setups whose copies the
hooks cannot see are refused at attach time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from dte_detector import CastDetector, ChangeSet
from dte_detector.changes import index_dtype
from dte_detector.steps import AdamWSteps

from ..errors import DeltaSyncError, UnsupportedModelError
from ..torch_actor import Method
from ..version_watch import VersionWatch
from .dp_union import WINDOW_BYTES, union_over_dp
from .shards import MainShard, inner_optimizers, main_shards, param_names

log = logging.getLogger(__name__)

ATTACHED = "detector_attached"
RELOADED = "reload_model_params"
OPTIMIZER_LOADED = "optimizer_state_loaded"
MODEL_WRITTEN = "model_param_written_outside_optimizer"
STEP_GAP = "step_gap"


class MegatronChanges:
    """Change sets of one rank's model params since the last commit (see the module doc).

    Build it with `attach`. After the optimizer steps: ``full_reason`` (None, or why this
    version must be full), ``collect()`` for a delta, ``commit()`` once the version was
    acknowledged.
    """

    def __init__(self, inners: Sequence[object], shards: Sequence[MainShard], method: Method,
                 window_bytes: int = WINDOW_BYTES):
        self.method = method
        self._window = window_bytes
        self._shards = {s.name: s for s in shards}
        self._dp_groups = []
        """Per distributed inner optimizer: its data-parallel group and its params' names."""
        by_main = {id(s.main): (s.name,) for s in shards}
        self._params = VersionWatch({s.name: s.param for s in shards})
        self._cast = CastDetector()
        self._steps = AdamWSteps(lambda main: by_main.get(id(main), ()))
        self._reason: str | None = ATTACHED
        self._torch_optimizers = [inner.optimizer for inner in inners]
        for inner in inners:
            stepped_here = {id(p) for g in inner.optimizer.param_groups for p in g["params"]}
            own = [s for s in shards if id(s.main) in stepped_here]
            group = getattr(inner, "data_parallel_group", None)
            if hasattr(inner, "shard_fp32_from_float16_groups") and group is not None:
                self._dp_groups.append((group, [s.name for s in own]))
            self._hook(inner, own)

    @property
    def full_reason(self) -> str | None:
        """Why the next version must be full, or None when ``collect`` is exact."""
        moved = self._params.moved()
        if moved and self._reason is None:
            self._reason = f"{MODEL_WRITTEN}: {moved[0]!r}"
        if self._reason is None and self.method == Method.ADAMW:
            gap = self._steps.gap()
            if gap is not None:
                return f"{STEP_GAP}: {gap.tensor!r}"
        return self._reason

    def collect(self) -> dict[str, ChangeSet]:
        """Per model param of this rank, its changed elements as flat indices.

        With the distributed optimizer over several data-parallel ranks this is a
        collective of each inner optimizer's DP group (``dp_union``): every rank of it
        calls ``collect`` for the same version (``GroupSender`` agrees on delta first).

        Raises:
            DeltaSyncError: ``full_reason`` is set (nothing here vouches for a delta).
        """
        reason = self.full_reason
        if reason is not None:
            raise DeltaSyncError("megatron change sets", expected="no reason for a full sync",
                                 got=reason)
        models = {name: shard.model for name, shard in self._shards.items()}
        if self.method == Method.CAST:
            local = {name: self._cast.changes(name, model) for name, model in models.items()}
        else:  # one batched inversion over every shard
            local = self._steps.changes_all(models)
        found = {name: _in_param(local[name], shard) for name, shard in self._shards.items()}
        for group, names in self._dp_groups:
            found.update(union_over_dp({n: found[n] for n in names}, group,
                                       window_bytes=self._window))
        return found

    def commit(self) -> None:
        """The version was delivered: start a new interval from the current params."""
        self._cast.clear()
        if self.method == Method.ADAMW:
            self._steps.commit(self._torch_optimizers)
        self._params.mark()
        self._reason = None

    def _hook(self, inner: object, shards: Sequence[MainShard]) -> None:
        _wrap(inner, "reload_model_params", lambda: self._needs_full(RELOADED))
        _wrap(inner, "load_state_dict", lambda: self._needs_full(OPTIMIZER_LOADED))
        if self.method == Method.CAST:
            # Replaces Megatron's copy with the same copies fused with the compare (one
            # pass on CUDA); the setups where Megatron's copy does more are refused.
            inner._copy_main_params_to_model_params = lambda: self._compare_and_copy(shards)
            return
        inner.optimizer.register_step_post_hook(
            lambda optimizer, *_: self._steps.record(optimizer))

    @torch.no_grad()
    def _compare_and_copy(self, shards: Sequence[MainShard]) -> None:
        # flat, as the model range: the non-distributed optimizer's masters keep the param's
        # shape (the distributed one's shards are flat already)
        self._cast.record_and_copy_all(
            {shard.name: (shard.main.detach().view(-1), shard.model) for shard in shards})

    def _needs_full(self, reason: str) -> None:
        if self._reason is None:
            self._reason = reason


def _in_param(found: ChangeSet, shard: MainShard) -> ChangeSet:
    """A shard's change set with indices into its whole (flattened) model param."""
    dtype = index_dtype(shard.param.numel())
    if shard.start == 0 and found.indices.dtype == dtype:
        return found
    return ChangeSet((found.indices.to(torch.int64) + shard.start).to(dtype), found.base_low,
                     found.base_high)


def attach(optimizer: object, model: torch.nn.Module | Sequence[torch.nn.Module], *,
           method: Method, window_bytes: int = WINDOW_BYTES) -> MegatronChanges:
    """Hook ``method``'s detector into a megatron-core optimizer built over ``model``.

    ``window_bytes`` bounds what ``collect`` gathers over a data-parallel group at once
    (``DTE_INVERSION_ALLREDUCE_WINDOW_MB``).

    Raises:
        UnsupportedModelError: ``Method.SNAPSHOT`` (keep a ``dte_detector.Snapshot``
            instead); an optimizer without the tested megatron-core structures; a setup
            whose copies the hooks cannot see (precision-aware optimizer, fp8 params,
            Megatron-FSDP, ``overlap_param_gather``).
    """
    if method == Method.SNAPSHOT:
        raise UnsupportedModelError("method", expected="adamw or cast", got="snapshot")
    names = param_names(model)
    inners = [i for i in inner_optimizers(optimizer) if not getattr(i, "is_stub_optimizer", False)]
    for inner in inners:
        _check_setup(inner)
    shards = [s for inner in inners for s in main_shards(inner, names)]
    return MegatronChanges(inners, shards, method, window_bytes)


def _check_setup(inner: object) -> None:
    config, ddp = getattr(inner, "config", None), getattr(inner, "ddp_config", None)
    refused = {  # key: (on, why the hooks cannot vouch for it)
        "use_precision_aware_optimizer": (
            getattr(config, "use_precision_aware_optimizer", False),
            "the inner optimizer writes the model params itself, past the hooked copy"),
        "fp8_param_gather": (getattr(config, "fp8_param_gather", False),
                             "fp8 params are quantised outside the hooked copy"),
        "use_megatron_fsdp": (getattr(ddp, "use_megatron_fsdp", False),
                              "Megatron-FSDP copies through its own buffers"),
        "overlap_param_gather": (
            getattr(ddp, "overlap_param_gather", False),
            "the params are gathered during the next forward, after a sync would read them"),
    }
    for key, (on, why) in refused.items():
        if on:
            raise UnsupportedModelError(key, expected=f"False ({why}; switch it off or use "
                                        "the snapshot detector)", got=True)


def _wrap(obj: object, method: str, call: Callable[[], None]) -> None:
    """Run ``call`` after ``obj.method`` on this instance only."""
    original = getattr(obj, method)

    def wrapped(*args, **kwargs):
        result = original(*args, **kwargs)
        call()
        return result
    setattr(obj, method, wrapped)

