"""End to end: `uv run apps/gsm8k_separation` on the real GSM8K train split, shortened.

Three runs share the data and the sampling settings: `run` (four steps, digests and
recovery on), `stopped` (two steps, the delta path and the diagnostics off) and `resumed`
(from `stopped`'s checkpoint to four steps, every diagnostic on). The last pair must end
on the same bits as `run`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[1]
GSM8K = Path(__file__).resolve().parents[2] / "shared/data/gsm8k"
TRAIN = GSM8K / "train.jsonl"
DIAGNOSTICS = "actor.weight_update_delta_diagnostics"
CHECKPOINT = "checkpoint/actor.safetensors"


def _app(out: Path, steps: int, *extra: str) -> tuple[Path, list[dict], str]:
    if not TRAIN.is_file():
        pytest.skip(f"GSM8K data not found at {TRAIN} (the shared data checkout is absent)")
    completed = subprocess.run(
        [sys.executable, str(ROOT / "apps/gsm8k_separation"), "--data", str(TRAIN),
         "--out", str(out), "--steps", str(steps), "--no-progress",
         "actor.weight_update_anchor_interval=2", "gconfig.max_new_tokens=8",
         f"{DIAGNOSTICS}.recovery=true", *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert 0 == completed.returncode, completed.stdout + completed.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, records, completed.stdout


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Four steps (five syncs) with an anchor after two deltas, on GSM8K's train split."""
    return _app(tmp_path_factory.mktemp("gsm8k"), 4)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """Two steps on the full-weight path, digests and phase timing off."""
    return _app(tmp_path_factory.mktemp("stopped"), 2, "actor.enable_delta_weight_update=false",
                f"{DIAGNOSTICS}.weight_digests=false", f"{DIAGNOSTICS}.phase_timing=false")


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, stopped):
    """From `stopped`'s checkpoint to four steps, every diagnostic on."""
    return _app(tmp_path_factory.mktemp("resumed"), 4, "--resume", str(stopped[0]),
                f"{DIAGNOSTICS}.snapshot_verification=true",
                f"{DIAGNOSTICS}.deterministic_rollout=true")


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


def test_switched_off_diagnostics_report_null(stopped):
    """The full-weight path sends every version in full; with digests and phase timing off
    `verified` and the timings are null, not made up."""
    _, records, stdout = stopped
    assert [("full", "delta_disabled")] * 3 == [(r["kind"], r["reason"]) for r in records]
    assert {None} == {r[key] for r in records
                      for key in ("verified", "rollout_identical", "detect_ms", "apply_ms")}
    assert "3 syncs (3 full, 0 delta, 0 anchor), 0 verified" in stdout


def test_resume_restarts_with_a_full_sync_and_every_check_passes(resumed):
    """The resumed run re-syncs the checkpoint's version in full, then sends deltas; each
    version passes the digest check, snapshot verification (no full fallback) and the
    deterministic rollout diagnostics."""
    _, records, stdout = resumed
    assert [(3, "full"), (4, "delta"), (5, "delta")] == [(r["version"], r["kind"])
                                                         for r in records]
    assert "resumed: version 3 after 2 steps" in stdout
    assert [True] * 3 == [r["verified"] for r in records]
    assert [True] * 3 == [r["rollout_identical"] for r in records]
    assert all(r["detect_ms"] is not None for r in records)


def test_resumed_run_ends_on_the_uninterrupted_bits(run, resumed):
    """Stopping after two steps and resuming gives the same masters and AdamW state, bit
    for bit, as the run that never stopped."""
    files = [out / CHECKPOINT for out, _, _ in (run, resumed)]
    assert [{"version": "5", "steps": "4"}] * 2 == [safe_open(f, "pt").metadata() for f in files]
    ours, theirs = (load_file(f) for f in files)
    assert ours.keys() == theirs.keys()
    differing = [name for name in ours
                 if not torch.equal(ours[name].reshape(-1).view(torch.uint8),
                                    theirs[name].reshape(-1).view(torch.uint8))]
    assert [] == differing
