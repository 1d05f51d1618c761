"""The rollout process: its own copy of the weights, updated from the staged-file store,
sampling with Hugging Face ``generate``, GSM8K rewards computed next to generation.

With deterministic rollout diagnostics on it holds a second, reference copy that receives
every version in full from its own store; `diagnose` samples the same prompts with the same
seed from both copies and compares tokens and log-probabilities bit for bit.
"""

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
        self.timing = self.delta.weight_update_delta_diagnostics.phase_timing
        self.policy, self.receiver, self.reader = self._copy(spec.store)
        self.reference = None
        if spec.reference_store is not None:
            self.reference, _, self.reference_reader = self._copy(
                spec.reference_store)

    def _copy(self, store: str) -> tuple[Any, Receiver, StagedReader]:
        policy = build_shell(self.spec.model, self.spec.shape, vocab_size=len(self.tokenizer))
        receiver = Receiver(weights(policy))
        return policy, receiver, StagedReader(store, receiver)

    def sync(self, *, version: int) -> dict[str, Any]:
        """Apply what the store committed; the rollout's digests when switched on."""
        start = time.perf_counter()
        applied = self.reader.poll()
        apply_ms = (time.perf_counter() - start) * 1e3
        if self.receiver.version != version:
            raise RuntimeError(f"rollout holds v{self.receiver.version} after applying "
                               f"{applied}, expected v{version}")
        if self.reference is not None:
            self.reference_reader.poll()
        result: dict[str, Any] = {"applied": applied, "digests": None,
                                  "apply_ms": apply_ms if self.timing else None}
        if self.delta.weight_update_delta_diagnostics.weight_digests:
            start = time.perf_counter()
            result["digests"] = digests(self.receiver.weights)
            result["digest_ms"] = (time.perf_counter() - start) * 1e3
        return result

    @torch.no_grad()
    def generate(self, *, prompts: list[str], answers: list[str], seed: int) -> dict[str, Any]:
        """`n_samples` sampled completions per prompt, padded into one batch, with rewards."""
        s = self.spec.sampling
        ids, prompt_mask, out = self._sample(self.policy, prompts, seed)
        completion = out.sequences[:, ids.shape[1]:]
        mask = _until_eos(completion, self.tokenizer.eos_token_id)
        texts = [self.tokenizer.decode(row[: int(m.sum())], skip_special_tokens=True)
                 for row, m in zip(completion, mask, strict=True)]
        golds = [Decimal(a) for a in answers for _ in range(s.n_samples)]
        rewards, exact = group_rewards(texts, golds, group_size=s.n_samples,
                                       shaped=self.spec.shaped_reward)
        return {"sequences": out.sequences.tolist(),
                "attention": torch.cat([prompt_mask, mask], dim=1).tolist(),
                "prompt_len": ids.shape[1], "rewards": rewards, "exact": exact,
                "sample": texts[0]}

    @torch.no_grad()
    def diagnose(self, *, prompts: list[str], seed: int) -> dict[str, Any]:
        """Sample `prompts` with `seed` from the delta-synced and the full-synced copy:
        identical when tokens and every token's log-probability match bit for bit."""
        answers = []
        for policy in (self.policy, self.reference):
            _, _, out = self._sample(policy, prompts, seed, logits=True)
            logits = torch.stack(out.logits, dim=1).float()
            chosen = out.sequences[:, -logits.shape[1]:]
            logprobs = torch.log_softmax(logits, -1).gather(-1, chosen.unsqueeze(-1))
            answers.append((out.sequences, logprobs))
        (tokens, logprobs), (ref_tokens, ref_logprobs) = answers
        same_tokens = torch.equal(tokens, ref_tokens)
        return {"identical": same_tokens and torch.equal(logprobs.view(torch.int32),
                                                         ref_logprobs.view(torch.int32)),
                "tokens": int(tokens.numel())}

    def _sample(self, policy: Any, prompts: list[str], seed: int, *, logits: bool = False):
        s = self.spec.sampling
        encoded = self.tokenizer(prompts, return_tensors="pt", padding=True,
                                 padding_side="left")
        ids = encoded.input_ids.repeat_interleave(s.n_samples, dim=0)
        prompt_mask = encoded.attention_mask.repeat_interleave(s.n_samples, dim=0)
        torch.manual_seed(seed)
        out = policy.generate(input_ids=ids, attention_mask=prompt_mask, do_sample=True,
                              temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                              max_new_tokens=s.max_new_tokens,
                              pad_token_id=self.tokenizer.pad_token_id,
                              eos_token_id=self.tokenizer.eos_token_id,
                              # only the diagnostics read logits: ~150k floats a token
                              return_dict_in_generate=True, output_logits=logits)
        return ids, prompt_mask, out

    def close(self) -> None:
        """Nothing to release."""


def _until_eos(completion: torch.Tensor, eos: int) -> torch.Tensor:
    """1 for each token up to and including the first EOS, 0 after it."""
    is_eos = (completion == eos).long()
    return ((is_eos.cumsum(dim=1) - is_eos) == 0).long()
