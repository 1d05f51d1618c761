"""Ctrl-C (SIGINT) and SIGTERM stop a running job cleanly: exit 130, one line, the finished
syncs in ``metrics.jsonl`` and ``sync.png``, no worker process left, and meanwhile a second
job on the same ``--out`` is refused."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "apps/gsm8k_separation"
TRAIN = ROOT.parent / "shared/data/gsm8k/train.jsonl"
FINISHED = 2
"""Syncs to wait for before the signal."""
WAIT_S = 300.0


def _children(pid: int) -> set[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def _running(pid: int) -> bool:
    """`pid` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_after_the_second_sync_keeps_the_finished_syncs(tmp_path, signum):
    """The job, signalled once two syncs are in metrics.jsonl, exits 130 with one line, keeps
    those syncs (versions 1, 2, ... in order) and writes sync.png; its worker processes are
    gone. While it runs, a second job on its --out exits 2."""
    if not TRAIN.is_file():
        pytest.skip(f"GSM8K data not found at {TRAIN} (the shared data checkout is absent)")
    out = tmp_path / "run"
    job = subprocess.Popen(
        [sys.executable, str(APP), "--data", str(TRAIN), "--out", str(out), "--steps", "50",
         "--no-progress", "gconfig.max_new_tokens=16"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + WAIT_S
        while len(_records(out)) < FINISHED:
            assert job.poll() is None, job.communicate()
            assert time.monotonic() < deadline, "no two syncs in time"
            workers |= _children(job.pid)
            time.sleep(0.2)
        workers |= _children(job.pid)
        second = subprocess.run([sys.executable, str(APP), "--out", str(out), "--overwrite"],
                                cwd=ROOT, capture_output=True, text=True, timeout=120,
                                check=False)
        job.send_signal(signum)
        stdout, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()  # reaped: no zombie for later tests' checks of their children
    assert 2 == second.returncode and "another job is writing" in second.stderr
    assert 130 == job.returncode, stdout + stderr
    assert "Traceback" not in stderr
    done = _records(out)
    assert stderr.strip().splitlines() == [
        f"interrupted after {len(done)} finished syncs; wrote {out}/metrics.jsonl and "
        f"{out}/sync.png"]
    assert len(done) >= FINISHED
    assert list(range(1, len(done) + 1)) == [r["version"] for r in done]
    assert (out / "sync.png").stat().st_size > 0
    assert len(workers) >= 2  # the actor and the rollout (and multiprocessing's tracker)
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [] == [pid for pid in workers if _running(pid)]
