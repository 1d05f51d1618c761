"""GSM8K GRPO with separated actor and rollout processes and exact sparse weight sync.

``uv run apps/gsm8k_separation`` runs the embedded profile (configs/local.yaml): a tiny
random Qwen3, an actor process (torch AdamW over fp32 masters, bf16 weights) and a
rollout process (HF ``generate``), synced through a staged-file store. See README.md.
"""
