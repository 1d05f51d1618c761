"""The actor process: GRPO updates of a bf16 policy through fp32 AdamW masters, delta sync out.

Each `train` is exactly one optimizer step (``ppo_n_minibatches: 1``), the shape the
``adamw`` detector needs: the loss's gradients are taken on the bf16 policy, copied to
the fp32 masters of an `areal_dte.TorchActor`, ``TorchActor.step`` runs the real
``torch.optim.AdamW`` and casts the masters into its bf16 model copy, which is then copied
into the policy for the next forward. `sync` delivers that copy through the staged-file
store (`dte_transport.StagedLink`): full first, then deltas, anchors as configured.

The diagnostics switches act here too: snapshot verification (`areal_dte.TorchActor`'s
``verify``), phase timing (the report's per-phase milliseconds, else None), recovery (a
checkpoint after every sync; ``--resume`` starts from one) and deterministic rollout
diagnostics (every version also goes in full to a second store, for the rollout's
full-synced reference copy).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from areal_dte import Method, TorchActor
from dte_codec import digests
from dte_config import read_env
from dte_transport import Sender, StagedLink

from . import checkpoint
from .grpo import clipped_policy_loss, group_advantages
from .model import build_policy, load_tokenizer
from .spec import JobSpec

log = logging.getLogger(__name__)

DELTA_OFF = "delta_disabled"
REFERENCE = "deterministic_rollout_reference"


class ActorWorker:
    """Requests served in the actor process (see `worker.serve`)."""

    def __init__(self, spec: JobSpec):
        self.spec = spec
        self.delta = read_env(spec.env)
        self.diagnostics = self.delta.weight_update_delta_diagnostics
        vocab = len(load_tokenizer(spec.model))
        self.policy = build_policy(spec.model, spec.shape, vocab_size=vocab, seed=spec.seed)
        self.params = dict(self.policy.named_parameters())
        masters = {n: torch.nn.Parameter(p.detach().float().clone())
                   for n, p in self.params.items()}
        o = spec.optim
        optimizer = torch.optim.AdamW(list(masters.values()), lr=o.lr, betas=o.betas, eps=o.eps,
                                      weight_decay=o.weight_decay)
        self.start = checkpoint.Saved(version=0, steps=0)
        if spec.resume is not None:
            self.start = checkpoint.load(Path(spec.resume), masters, optimizer)
            with torch.no_grad():
                for name, param in self.params.items():
                    param.copy_(masters[name])
        self.steps = self.start.steps
        self.links = [StagedLink(spec.store)]
        # With weight digests on, the store checks every version against the actor's own
        # weights before committing it, so a detector miss becomes a full sync.
        sender = Sender(self.links[0], anchor_interval=self.delta.weight_update_anchor_interval,
                        digests=self.diagnostics.weight_digests)
        self.actor = TorchActor(masters, optimizer, sender,
                                method=Method(self.delta.weight_update_delta_method.value),
                                verify=self.diagnostics.snapshot_verification)
        self.reference = None
        if spec.reference_store is not None:
            self.links.append(StagedLink(spec.reference_store))
            self.reference = Sender(self.links[-1], anchor_interval=0)
        self.numel = sum(t.numel() for t in self.actor.model.values())

    def describe(self) -> dict[str, Any]:
        """Parameter count, dense bytes of the synced weights, where a resumed run starts."""
        return {"params": self.numel,
                "dense_bytes": sum(t.numel() * t.element_size()
                                   for t in self.actor.model.values()),
                "version": self.start.version, "steps": self.start.steps}

    def train(self, *, sequences: list[list[int]], attention: list[list[int]], prompt_len: int,
              rewards: list[float]) -> dict[str, float]:
        """One GRPO step on a batch of groups: loss, backward, exactly one AdamW step."""
        ids, attn = torch.tensor(sequences), torch.tensor(attention)
        advantages = group_advantages(torch.tensor(rewards),
                                      group_size=self.spec.sampling.n_samples)
        logprobs = self._logprobs(ids, attn, prompt_len)
        mask = attn[:, prompt_len:]
        loss = clipped_policy_loss(logprobs, logprobs.detach(), advantages, mask,
                                   eps_clip=self.spec.optim.eps_clip,
                                   eps_clip_higher=self.spec.optim.eps_clip_higher)
        self.policy.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = self._step()
        self.steps += 1
        return {"loss": float(loss.detach()), "grad_norm": grad_norm}

    def _logprobs(self, ids: torch.Tensor, attn: torch.Tensor, prompt_len: int) -> torch.Tensor:
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        hidden = self.policy.model(input_ids=ids, attention_mask=attn,
                                   position_ids=positions).last_hidden_state
        # Logits only where completion tokens are predicted: the vocabulary is ~152k wide.
        logits = self.policy.lm_head(hidden[:, prompt_len - 1:-1]).float()
        targets = ids[:, prompt_len:].unsqueeze(-1)
        return torch.log_softmax(logits, dim=-1).gather(-1, targets).squeeze(-1)

    def _step(self) -> float:
        masters = self.actor.masters
        for name, param in self.params.items():
            masters[name].grad = None if param.grad is None else param.grad.float()
        clip = self.spec.optim.gradient_clipping
        grads = [m for m in masters.values() if m.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(grads, clip if clip > 0 else float("inf"))
        self.actor.step()
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(self.actor.model[name])
        return float(norm)

    def sync(self, *, version: int) -> dict[str, Any]:
        """Deliver the bf16 weights as `version`; the `SyncReport` as plain values."""
        if self.delta.enable_delta_weight_update:
            report = self.actor.sync(version)
        else:  # the full-weight path
            report = self.actor.sync_full(version, reason=DELTA_OFF)
        if self.reference is not None:
            self.reference.sync_full(self.actor.model, version=version, reason=REFERENCE)
        if self.spec.checkpoint is not None:
            checkpoint.save(Path(self.spec.checkpoint), self.actor.masters, self.actor.optimizer,
                            saved=checkpoint.Saved(version=version, steps=self.steps))
        return {"version": report.version, "kind": report.kind.value, "reason": report.reason,
                "payload_bytes": report.payload_bytes, "dense_bytes": report.dense_bytes,
                "changed": report.changed, "numel": self.numel,
                "ms": dict(report.ms) if self.diagnostics.phase_timing else None}

    def verify(self, *, version: int, rollout_digests: dict[str, str]) -> bool:
        """True when every rollout tensor's digest equals the actor's bf16 copy's."""
        ours = digests(self.actor.model)
        differing = sorted(n for n in ours.keys() | rollout_digests.keys()
                           if ours.get(n) != rollout_digests.get(n))
        if differing:
            log.error("v%d: %d tensors differ from the actor's, e.g. %s", version,
                      len(differing), differing[:3])
        return not differing

    def close(self) -> None:
        """Release the stores."""
        for link in self.links:
            link.close()
