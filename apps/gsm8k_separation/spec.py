"""What the actor and rollout processes need to start: one picklable value per job."""

from __future__ import annotations

from pathlib import Path

import attrs
from dte_config import export_env

from .experiment import ModelShape, Profile


@attrs.frozen(kw_only=True)
class Sampling:
    """How the rollout samples (``gconfig.*``)."""

    prompts_per_step: int
    """Problems per GRPO step (``train_dataset.batch_size``)."""
    n_samples: int
    """Completions per prompt: the GRPO group size."""
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    """0: no top-k filter."""


@attrs.frozen(kw_only=True)
class Optim:
    """The actor's AdamW and loss settings (``actor.optimizer.*``, ``actor.eps_clip``)."""

    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    gradient_clipping: float
    """Max global gradient norm; 0 turns clipping off."""
    eps_clip: float
    eps_clip_higher: float | None


@attrs.frozen(kw_only=True)
class JobSpec:
    """Start-up settings of both worker processes."""

    store: str
    """The staged-file store's directory (actor writes, rollout reads)."""
    reference_store: str | None
    """Deterministic rollout diagnostics: a second store that gets every version in full,
    for the rollout's full-synced reference copy; None when the diagnostics are off."""
    checkpoint: str | None
    """Recovery: the folder the actor writes its checkpoint to after every sync."""
    resume: str | None
    """``--resume``: the checkpoint (or a run folder holding one) the actor starts from."""
    env: dict[str, str]
    """The ``DTE_*`` variables `dte_config.export_env` wrote; workers rebuild the delta
    settings from them with `dte_config.read_env`, as cluster workers do."""
    model: str | None
    """A local checkpoint path; None: a random tiny Qwen3 of `shape`."""
    shape: ModelShape
    seed: int
    sampling: Sampling
    optim: Optim
    shaped_reward: bool


def _get(tree, dotted: str, default):
    node = tree
    for part in dotted.split("."):
        if node is None or part not in node:
            return default
        node = node[part]
    return default if node is None else node


def job_spec(profile: Profile, *, store: Path, model: str | None,
             reference_store: Path | None = None, checkpoint: Path | None = None,
             resume: Path | None = None) -> JobSpec:
    """The `JobSpec` of `profile`; AReaL's defaults where the YAML leaves a key out."""
    tree, env = profile.tree, {}
    export_env(profile.run.delta, environ=env, tree={})
    sampling = Sampling(prompts_per_step=int(_get(tree, "train_dataset.batch_size", 2)),
                        n_samples=int(_get(tree, "gconfig.n_samples", 4)),
                        max_new_tokens=int(_get(tree, "gconfig.max_new_tokens", 24)),
                        temperature=float(_get(tree, "gconfig.temperature", 1.0)),
                        top_p=float(_get(tree, "gconfig.top_p", 1.0)),
                        top_k=int(_get(tree, "gconfig.top_k", 0)))
    higher = _get(tree, "actor.eps_clip_higher", None)
    optim = Optim(lr=float(_get(tree, "actor.optimizer.lr", 1e-5)),
                  weight_decay=float(_get(tree, "actor.optimizer.weight_decay", 0.01)),
                  betas=(float(_get(tree, "actor.optimizer.beta1", 0.9)),
                         float(_get(tree, "actor.optimizer.beta2", 0.999))),
                  eps=float(_get(tree, "actor.optimizer.eps", 1e-8)),
                  gradient_clipping=float(_get(tree, "actor.optimizer.gradient_clipping", 1.0)),
                  eps_clip=float(_get(tree, "actor.eps_clip", 0.2)),
                  eps_clip_higher=None if higher is None else float(higher))
    return JobSpec(store=str(store), reference_store=_text(reference_store),
                   checkpoint=_text(checkpoint), resume=_text(resume), env=env, model=model, shape=profile.embedded.model,
                   seed=int(_get(tree, "seed", 1)), sampling=sampling, optim=optim,
                   shaped_reward=profile.embedded.shaped_reward)


def _text(path: Path | None) -> str | None:
    return None if path is None else str(path)
