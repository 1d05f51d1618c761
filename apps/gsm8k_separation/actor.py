"""The actor process: GRPO updates of a bf16 policy through fp32 AdamW masters, delta sync out.

Each `train` is exactly one optimizer step (``ppo_n_minibatches: 1``), the shape the
``adamw`` detector needs: the loss's gradients are taken on the bf16 policy, copied to
the fp32 masters of an `areal_dte.TorchActor`, ``TorchActor.step`` runs the real
``torch.optim.AdamW`` and casts the masters into its bf16 model copy, which is then copied
into the policy for the next forward. `sync` delivers that copy through the staged-file
store (`dte_transport.StagedLink`): full first, then deltas, anchors as configured.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from areal_dte import Method, TorchActor
from dte_codec import digests
from dte_config import read_env
from dte_transport import Sender, StagedLink

from .grpo import clipped_policy_loss, group_advantages
from .model import build_policy, load_tokenizer
from .spec import JobSpec

log = logging.getLogger(__name__)

DELTA_OFF = "delta_disabled"


class ActorWorker:
    """Requests served in the actor process (see `worker.serve`)."""

    def __init__(self, spec: JobSpec):
        self.spec = spec
        self.delta = read_env(spec.env)
        vocab = len(load_tokenizer(spec.model))
        self.policy = build_policy(spec.model, spec.shape, vocab_size=vocab, seed=spec.seed)
        self.params = dict(self.policy.named_parameters())
        masters = {n: torch.nn.Parameter(p.detach().float().clone())
                   for n, p in self.params.items()}
        o = spec.optim
        optimizer = torch.optim.AdamW(list(masters.values()), lr=o.lr, betas=o.betas, eps=o.eps,
                                      weight_decay=o.weight_decay)
        self.link = StagedLink(spec.store)
        sender = Sender(self.link, anchor_interval=self.delta.weight_update_anchor_interval)
        self.actor = TorchActor(masters, optimizer, sender,
                                method=Method(self.delta.weight_update_delta_method.value))
        self.numel = sum(t.numel() for t in self.actor.model.values())

    def describe(self) -> dict[str, Any]:
        """Parameter count and dense bytes of the synced weights."""
        return {"params": self.numel,
                "dense_bytes": sum(t.numel() * t.element_size()
                                   for t in self.actor.model.values())}

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
            report = self.actor.sender.sync_full(self.actor.model, version=version,
                                                 reason=DELTA_OFF)
        return {"version": report.version, "kind": report.kind.value, "reason": report.reason,
                "payload_bytes": report.payload_bytes, "dense_bytes": report.dense_bytes,
                "changed": report.changed, "numel": self.numel, "ms": dict(report.ms)}

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
        """Release the store."""
        self.link.close()
