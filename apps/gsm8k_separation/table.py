"""The per-sync table printed while a job runs."""

from __future__ import annotations

from typing import Any

COLUMNS = (("ver", 4), ("kind", 6), ("method", 7), ("changed%", 9), ("payload B", 11),
           ("dense B", 11), ("B/chg", 6), ("detect", 7), ("encode", 7), ("send", 7),
           ("apply", 7), ("verified", 8), ("same", 5), ("reward", 7))
"""(header, width); times are milliseconds; ``same``: the deterministic rollout diagnostics
(delta-synced and full-synced rollouts sampled identically)."""
CHECK = {True: "yes", False: "NO", None: "off"}


def header() -> str:
    """The table's header line."""
    return " ".join(f"{name:>{width}}" for name, width in COLUMNS)


def row(r: dict[str, Any]) -> str:
    """One record as a table line."""
    cells = (
        r["version"], r["kind"], r["method"],
        _num(None if r["changed_fraction"] is None else 100 * r["changed_fraction"], "{:.3f}"),
        r["payload_bytes"], r["dense_bytes"], _num(r["bytes_per_changed"], "{:.2f}"),
        _num(r["detect_ms"], "{:.1f}"), _num(r["encode_ms"], "{:.1f}"),
        _num(r["send_ms"], "{:.1f}"), _num(r["apply_ms"], "{:.1f}"),
        CHECK[r["verified"]], CHECK[r["rollout_identical"]], _num(r["reward_mean"], "{:.3f}"),
    )
    return " ".join(f"{cell!s:>{width}}" for cell, (_, width) in zip(cells, COLUMNS, strict=True))


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else spec.format(value)
