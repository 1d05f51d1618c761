"""End to end: `uv run apps/gsm8k_separation` on the real GSM8K train split, shortened."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GSM8K = Path(__file__).resolve().parents[2] / "shared/data/gsm8k"
TRAIN = GSM8K / "train.jsonl"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Four steps (five syncs) with an anchor after two deltas, on GSM8K's train split."""
    if not TRAIN.is_file():
        pytest.skip(f"GSM8K data not found at {TRAIN} (the shared data checkout is absent)")
    out = tmp_path_factory.mktemp("gsm8k")
    completed = subprocess.run(
        [sys.executable, str(ROOT / "apps/gsm8k_separation"), "--data", str(TRAIN),
         "--out", str(out), "--steps", "4", "--no-progress",
         "actor.weight_update_anchor_interval=2", "gconfig.max_new_tokens=16"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert 0 == completed.returncode, completed.stdout + completed.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, records, completed.stdout


def test_kinds_in_order(run):
    """The first sync is full, deltas follow, and an anchor comes after two committed deltas."""
    _, records, _ = run
    assert ["full", "delta", "delta", "anchor", "delta"] == [r["kind"] for r in records]
    assert [1, 2, 3, 4, 5] == [r["version"] for r in records]


def test_every_sync_verified(run):
    """The rollout's weight digests equal the actor's after every sync."""
    _, records, _ = run
    assert [True] * len(records) == [r["verified"] for r in records]


def test_deltas_change_something_and_are_smaller(run):
    """Every delta reports a non-zero changed fraction and fewer bytes than dense."""
    _, records, _ = run
    deltas = [r for r in records if r["kind"] == "delta"]
    assert all(0 < r["changed_fraction"] < 1 for r in deltas), deltas
    assert all(r["payload_bytes"] < r["dense_bytes"] for r in deltas), deltas
    assert all("adamw" == r["method"] for r in deltas)


def test_record_keys_and_outputs(run):
    """Each record has the documented keys; sync.png is written; the table is printed."""
    out, records, stdout = run
    keys = {"version", "kind", "method", "changed_fraction", "payload_bytes", "dense_bytes",
            "verified", "reward_mean", "detect_ms", "encode_ms", "send_ms", "apply_ms"}
    assert all(keys <= set(r) for r in records)
    assert records[0]["reward_mean"] is None and all(
        r["reward_mean"] is not None for r in records[1:])
    assert (out / "sync.png").stat().st_size > 0
    assert "verified" in stdout and "5 syncs (1 full, 3 delta, 1 anchor), 5 verified" in stdout
