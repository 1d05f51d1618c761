"""One record per sync: built from the actor's report and the rollout's answer, written as
``metrics.jsonl``, shown as a table row, and plotted as ``sync.png``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "sync.png"
DENSE_METHOD = "dense"
"""`method` of full and anchor syncs: every element is sent."""
PHASES = ("detect", "encode", "send")


def record(report: dict[str, Any], rollout: dict[str, Any], *, method: str,
           verified: bool | None, step: int, train: dict[str, Any] | None) -> dict[str, Any]:
    """The metrics record of one sync.

    Args:
        report: `ActorWorker.sync`'s answer (``ms`` None: phase timing off).
        rollout: `RolloutWorker.sync`'s answer.
        method: the change detector (used for deltas).
        verified: digests equal (None: digests off).
        step: optimizer steps taken before this version.
        train: the step's rewards and loss (None for the first version).
    """
    delta = report["kind"] == "delta"
    changed = report["changed"]
    ms = report["ms"]
    entry = {
        "version": report["version"], "kind": report["kind"], "reason": report["reason"],
        "method": method if delta else DENSE_METHOD, "step": step,
        "changed": changed, "numel": report["numel"],
        "changed_fraction": changed / report["numel"] if delta and report["numel"] else None,
        "payload_bytes": report["payload_bytes"], "dense_bytes": report["dense_bytes"],
        "bytes_per_changed": report["payload_bytes"] / changed if delta and changed else None,
        **{f"{phase}_ms": None if ms is None else ms.get(phase, 0.0) for phase in PHASES},
        "apply_ms": rollout["apply_ms"], "digest_ms": rollout.get("digest_ms"),
        "verified": verified, "rollout_identical": None,
        "reward_mean": None, "reward_exact_mean": None, "loss": None,
    }
    if train is not None:
        entry.update(reward_mean=_mean(train["rewards"]), reward_exact_mean=_mean(train["exact"]),
                     loss=train["loss"])
    return entry


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def write_jsonl(records: Sequence[dict[str, Any]], out: Path) -> Path:
    """``out/metrics.jsonl``, one record per line."""
    path = out / METRICS_FILE
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
    return path


def plot(records: Sequence[dict[str, Any]], out: Path) -> Path:
    """``out/sync.png``: bytes per version by kind, changed fraction, reward."""
    import matplotlib  # noqa: PLC0415 - only when writing files

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    versions = [r["version"] for r in records]
    colours = {"full": "tab:red", "anchor": "tab:orange", "delta": "tab:blue"}
    figure, (ax_bytes, ax_changed, ax_reward) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    for kind, colour in colours.items():
        chosen = [r for r in records if r["kind"] == kind]
        ax_bytes.bar([r["version"] for r in chosen], [r["payload_bytes"] for r in chosen],
                     color=colour, label=kind)
    ax_bytes.plot(versions, [r["dense_bytes"] for r in records], "k--", label="dense bf16")
    ax_bytes.set_yscale("log")
    ax_bytes.set_ylabel("payload bytes")
    ax_bytes.legend()
    deltas = [r for r in records if r["changed_fraction"] is not None]
    ax_changed.plot([r["version"] for r in deltas],
                    [100 * r["changed_fraction"] for r in deltas], "o-")
    ax_changed.set_ylabel("changed elements (%)")
    trained = [r for r in records if r["reward_mean"] is not None]
    ax_reward.plot([r["version"] for r in trained], [r["reward_mean"] for r in trained], "o-",
                   label="reward (shaped where used)")
    ax_reward.plot([r["version"] for r in trained], [r["reward_exact_mean"] for r in trained],
                   "s--", label="exact-match reward")
    ax_reward.set_ylabel("mean reward")
    ax_reward.set_xlabel("weight version")
    ax_reward.legend()
    figure.tight_layout()
    path = out / PLOT_FILE
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
