"""One record per sync: built from the actor's report and the rollout's answer, written as
``metrics.jsonl``, shown as a table row, and plotted as ``sync.png``."""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "sync.png"
DENSE_METHOD = "dense"
"""`method` of full and anchor syncs: every element is sent."""
PHASES = ("detect", "encode", "send")
PHASE_COLOURS = ("tab:purple", "tab:olive", "tab:cyan", "tab:gray")
"""detect, encode, send (actor) and apply (rollout); apart from the colours of the kinds."""


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


def start_jsonl(out: Path) -> Path:
    """An empty ``out/metrics.jsonl``, which `append_jsonl` fills as syncs finish."""
    path = out / METRICS_FILE
    path.write_text("")
    return path


def append_jsonl(record: dict[str, Any], out: Path) -> None:
    """Add one record to ``out/metrics.jsonl`` (flushed, so a reader sees finished syncs)."""
    with open(out / METRICS_FILE, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record, sort_keys=True) + "\n")


def title(*, model: str, method: str, run: str, when: datetime.datetime) -> str:
    """The plot's title: the run's folder, model, change detector and date."""
    return f"{run}: {model}, method {method}, {when:%Y-%m-%d %H:%M}"


def plot(records: Sequence[dict[str, Any]], out: Path, *, heading: str) -> Path:
    """``out/sync.png``: bytes per version by kind, per-phase time, changed fraction, reward;
    legends sit beside the axes, never over the data."""
    import matplotlib  # noqa: PLC0415 - only when writing files

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    figure, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True, layout="constrained")
    figure.suptitle(heading)
    _bytes(axes[0], records)
    _timing(axes[1], records)
    deltas = [r for r in records if r["changed_fraction"] is not None]
    axes[2].plot([r["version"] for r in deltas], [100 * r["changed_fraction"] for r in deltas],
                 "o-")
    axes[2].set_ylabel("changed elements (%)")
    trained = [r for r in records if r["reward_mean"] is not None]
    axes[3].plot([r["version"] for r in trained], [r["reward_mean"] for r in trained], "o-",
                 label="reward (shaped where used)")
    axes[3].plot([r["version"] for r in trained], [r["reward_exact_mean"] for r in trained],
                 "s--", label="exact-match reward")
    axes[3].set_ylabel("mean reward")
    axes[3].set_xlabel("weight version")
    axes[3].xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    path = out / PLOT_FILE
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _bytes(ax: Any, records: Sequence[dict[str, Any]]) -> None:
    colours = {"full": "tab:red", "anchor": "tab:orange", "delta": "tab:blue"}
    for kind, colour in colours.items():
        chosen = [r for r in records if r["kind"] == kind]
        if not chosen:
            continue
        ax.bar([r["version"] for r in chosen], [r["payload_bytes"] for r in chosen],
               color=colour, label=kind)
    ax.plot([r["version"] for r in records], [r["dense_bytes"] for r in records], "k--",
            label="dense bf16")
    ax.set_yscale("log")
    ax.set_ylabel("payload bytes")


def _timing(ax: Any, records: Sequence[dict[str, Any]]) -> None:
    """Stacked per-phase milliseconds of each sync (absent when phase timing is off)."""
    timed = [r for r in records if r["apply_ms"] is not None]
    versions = [r["version"] for r in timed]
    bottom = [0.0] * len(timed)
    for phase, colour in zip((*PHASES, "apply"), PHASE_COLOURS, strict=True):
        values = [r[f"{phase}_ms"] or 0.0 for r in timed]
        ax.bar(versions, values, bottom=bottom, label=f"{phase} ms", color=colour)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    if not timed:
        ax.text(0.5, 0.5, "phase timing off", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("ms per sync")
