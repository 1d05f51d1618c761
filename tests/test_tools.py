"""The benchmark scripts run end to end (``--quick``), so they cannot rot unnoticed."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[1]


def run_tool(*args: str) -> list[str]:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, check=True)
    return done.stdout.strip().splitlines()


def test_bench_codec_quick_meets_the_byte_target():
    """The last line reports bytes per changed element against the 6.0 baseline, <= 2.5."""
    last = run_tool("tools/bench_codec.py", "--quick")[-1]
    match = re.fullmatch(r"bytes_per_changed=(\d+\.\d+) baseline=6\.0", last)
    assert match is not None, last
    assert float(match.group(1)) <= 2.5


def test_bench_detectors_quick_misses_nothing():
    """Every row reports 0 missed elements for the guarded inversion."""
    rows = [line for line in run_tool("tools/bench_detectors.py", "--quick")
            if line.startswith("| 20")]
    assert 2 == len(rows)
    assert all("0" == row.split("|")[7].strip() for row in rows)


def test_bench_actor_checks_runs():
    """The checks' benchmark prints its summary line and one Markdown row."""
    lines = run_tool("tools/bench_actor_checks.py", "--tensors", "8", "--numel", "64",
                     "--reps", "2")
    assert lines[0].startswith("8 tensors x 64 elements on cpu: checks ")
    assert lines[1].startswith("| 20") and lines[1].count("|") == 10


def test_bench_encode_host_runs():
    """The encoders' host-time benchmark prints a Markdown row per delta case (145
    matrices changed; all 290 as per-tensor views and as a detector's flat runs) and one
    for the full encoder."""
    rows = run_tool("tools/bench_encode_host.py", "--reps", "2")
    cases = ["145 changed (matrices changed)", "290 changed (all changed, views)",
             "290 changed (all changed, flat)"]
    end = r" \|.* \|.* \| \d{4}-\d\d-\d\d \|"
    front = (r" ms \(least [\d.]+; [\d.]+ before ``_stats`` is queued, then [\d.]+ until "
             r"``_escape_counts`` is; \d+ device ops\)")
    patterns = [rf"\| encode host  \| 290 tensors, {re.escape(case)} \| encode_delta "
                rf"[\d.]+{front}{end}" for case in cases]
    patterns.append(rf"\| encode host  \| 290 tensors \| encode_full [\d.]+ ms \(least [\d.]+\)"
                    rf"{end}")
    assert len(patterns) == len(rows), rows
    for pattern, row in zip(patterns, rows):
        assert re.fullmatch(pattern, row), row


def test_bench_detect_host_runs():
    """The detectors' host-time benchmark prints a front and a whole row per detector."""
    rows = run_tool("tools/bench_detect_host.py", "--reps", "2")
    assert [f"{detector} host {row}" for detector in ("inversion", "cast")
            for row in ("front", "whole")] == [row.split("|")[1].strip() for row in rows]
    for row in rows:
        assert re.fullmatch(r"\| [a-z ]+ \| 290 tensors, 16 groups \| median [\d.]+ ms "
                            r"\| p90 [\d.]+ ms \|", row), row


@pytest.mark.parametrize("gpus", ["1", "2"])
def test_bench_sync_smoke_is_bitwise(tmp_path, gpus):
    """The sync benchmark on a tiny model on the CPU (two ranks over gloo for ``--gpus
    2``): one Markdown row whose last column (every sync bitwise) is True, and its JSON
    and plot."""
    (row,) = [line for line in run_tool("tools/bench_sync.py", "--smoke", "--gpus", gpus,
                                        "--steps", "2", "--warmup-steps", "1",
                                        "--out", str(tmp_path))
              if line.startswith("| 20")]
    assert "True" == row.split("|")[-2].strip()
    assert (tmp_path / "sync.json").exists() and (tmp_path / "sync.png").exists()


def test_trace_summary_gaps_start_at_the_sync(tmp_path):
    """``trace_summary.py --gaps`` on a trace without Python stacks: the host's front (from
    the first ``dte.*`` range to the first device op) and each later idle stretch, named
    by the ranges and ops that cover it; device ops closer than ``--min-gap-us`` join."""
    import gzip
    import json

    def event(cat, name, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    trace = tmp_path / "trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": [
            event("user_annotation", "dte.detect", 0, 1000),
            event("cpu_op", "aten::zeros", 10, 390),
            event("kernel", "_mark", 400, 100), event("kernel", "_gather", 550, 100),
            event("user_annotation", "dte.encode", 1000, 500),
            event("kernel", "_stats", 1250, 100)]}, f)
    lines = run_tool("tools/trace_summary.py", str(trace), "--gaps", "--min-gap-us", "60")
    assert lines[0].split() == ["1.0", "ms", "idle", "in", "2", "gaps"]
    assert lines[1].split() == ["0.40", "ms", "aten::zeros", "|", "dte.detect"]
    assert lines[2].split() == ["0.60", "ms", "dte.encode", "|", "dte.detect"]
