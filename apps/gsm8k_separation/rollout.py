"""The rollout process: its own copy of the weights, updated from the staged-file store,
sampling with Hugging Face ``generate``, GSM8K rewards computed next to generation."""

from __future__ import annotations

import time
from decimal import Decimal
from typing import Any

import torch
from dte_codec import digests
from dte_config import read_env
from dte_transport import Receiver, StagedReader

from .model import build_shell, load_tokenizer, weights
from .rewards import group_rewards
from .spec import JobSpec


class RolloutWorker:
    """Requests served in the rollout process (see `worker.serve`)."""

    def __init__(self, spec: JobSpec):
        self.spec = spec
        self.delta = read_env(spec.env)
        self.tokenizer = load_tokenizer(spec.model)
        self.policy = build_shell(spec.model, spec.shape, vocab_size=len(self.tokenizer))
        self.receiver = Receiver(weights(self.policy))
        self.reader = StagedReader(spec.store, self.receiver)

    def sync(self, *, version: int) -> dict[str, Any]:
        """Apply what the store committed; the rollout's digests when switched on."""
        start = time.perf_counter()
        applied = self.reader.poll()
        apply_ms = (time.perf_counter() - start) * 1e3
        if self.receiver.version != version:
            raise RuntimeError(f"rollout holds v{self.receiver.version} after applying "
                               f"{applied}, expected v{version}")
        result: dict[str, Any] = {"applied": applied, "apply_ms": apply_ms, "digests": None}
        if self.delta.weight_update_delta_diagnostics.weight_digests:
            start = time.perf_counter()
            result["digests"] = digests(self.receiver.weights)
            result["digest_ms"] = (time.perf_counter() - start) * 1e3
        return result

    @torch.no_grad()
    def generate(self, *, prompts: list[str], answers: list[str], seed: int) -> dict[str, Any]:
        """`n_samples` sampled completions per prompt, padded into one batch, with rewards."""
        s = self.spec.sampling
        encoded = self.tokenizer(prompts, return_tensors="pt", padding=True,
                                 padding_side="left")
        ids = encoded.input_ids.repeat_interleave(s.n_samples, dim=0)
        prompt_mask = encoded.attention_mask.repeat_interleave(s.n_samples, dim=0)
        torch.manual_seed(seed)
        out = self.policy.generate(input_ids=ids, attention_mask=prompt_mask, do_sample=True,
                                   temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                   max_new_tokens=s.max_new_tokens,
                                   pad_token_id=self.tokenizer.pad_token_id,
                                   eos_token_id=self.tokenizer.eos_token_id)
        completion = out[:, ids.shape[1]:]
        mask = _until_eos(completion, self.tokenizer.eos_token_id)
        texts = [self.tokenizer.decode(row[: int(m.sum())], skip_special_tokens=True)
                 for row, m in zip(completion, mask, strict=True)]
        golds = [Decimal(a) for a in answers for _ in range(s.n_samples)]
        rewards, exact = group_rewards(texts, golds, group_size=s.n_samples,
                                       shaped=self.spec.shaped_reward)
        return {"sequences": out.tolist(),
                "attention": torch.cat([prompt_mask, mask], dim=1).tolist(),
                "prompt_len": ids.shape[1], "rewards": rewards, "exact": exact,
                "sample": texts[0]}

    def close(self) -> None:
        """Nothing to release."""


def _until_eos(completion: torch.Tensor, eos: int) -> torch.Tensor:
    """1 for each token up to and including the first EOS, 0 after it."""
    is_eos = (completion == eos).long()
    return ((is_eos.cumsum(dim=1) - is_eos) == 0).long()
