"""The app's command line: every ordinary mistake is refused at startup with one line and
exit 2 (before a worker starts, writing nothing), a dry run ends with the verdict a real
run would give, and ``--help`` answers without importing torch."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gsm8k_separation.cli import main
from gsm8k_separation.inputs import claim_out

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "apps/gsm8k_separation"
CLUSTER = APP / "configs/gsm8k_grpo_qwen3_30b_a3b.yaml"
MODEL_CHECK_S = 10.0
"""The model-path refusals must come within this many seconds of the start."""


def test_cluster_config_dry_run_prints_the_config_and_the_real_runs_refusal(capsys):
    """--dry-run of the seed's Qwen3-30B-A3B config prints it resolved, then ends with the
    refusal a real run gives (no scheduler.type), with the same exit code 2."""
    assert 2 == main(["--config", str(CLUSTER), "--dry-run"])
    dry = capsys.readouterr()
    assert "backend: megatron:(attn:d2p1t4|ffn:d1p1e8)" in dry.out
    assert "weight_update_anchor_interval: 20" in dry.out
    assert 2 == main(["--config", str(CLUSTER)])
    assert dry.err == capsys.readouterr().err
    assert dry.err.startswith("error: scheduler.type=None: ")


def test_embedded_dry_run_ends_with_what_would_run(capsys):
    """--dry-run of the embedded profile checks the inputs and names what would run, exit 0."""
    assert 0 == main(["--dry-run", "--steps", "3"])
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("dry run: would run the embedded job: 512 problems from generated")
    assert "3 steps, 4 syncs; model tiny random Qwen3; output none (no --out)" in last


def test_adamw_with_two_minibatches_is_rejected_at_startup(capsys):
    """actor.ppo_n_minibatches=2 with the adamw method exits 2 naming the key and the fix."""
    assert 2 == main(["--config", str(CLUSTER), "--dry-run", "actor.ppo_n_minibatches=2"])
    err = capsys.readouterr().err
    assert err.startswith("config error: actor.ppo_n_minibatches=2: ")
    assert "fix: set actor.ppo_n_minibatches=1" in err


def test_cluster_config_needs_a_scheduler(capsys):
    """Without --dry-run a cluster config needs scheduler.type; it never runs as the
    embedded job."""
    assert 2 == main(["--config", str(CLUSTER)])
    assert capsys.readouterr().err.startswith("error: scheduler.type=None: ")


def test_cluster_mode_without_areal_names_the_extra(capsys):
    """scheduler.type=local in the default environment (no AReaL) exits 2 with the hint."""
    assert 2 == main(["--config", str(CLUSTER), "scheduler.type=local"])
    err = capsys.readouterr().err
    assert "cannot be imported" in err and "uv sync --extra areal" in err


def test_recovery_needs_an_out_folder(capsys):
    """recovery=true writes its checkpoint into --out: without one the job is refused."""
    assert 2 == main(["actor.weight_update_delta_diagnostics.recovery=true"])
    assert "give --out" in capsys.readouterr().err


def test_resume_without_a_checkpoint_is_refused(tmp_path, capsys):
    """--resume DIR with no checkpoint in DIR exits 2 naming the file it looked for."""
    assert 2 == main(["--resume", str(tmp_path), "--out", str(tmp_path / "out")])
    assert f"no checkpoint in {tmp_path}: expected {tmp_path}/checkpoint/actor.safetensors" in (
        capsys.readouterr().err)


def _earlier_run(folder: Path) -> dict[str, bytes]:
    """An earlier run's --out folder; returns its files and contents."""
    (folder / "store").mkdir(parents=True)
    (folder / "metrics.jsonl").write_text('{"version": 1}\n')
    (folder / "sync.png").write_bytes(b"png")
    return _contents(folder)


def _contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"<dir>"
            for p in sorted(folder.rglob("*"))}


def _inputs(tmp: Path) -> list:
    """(id, arguments, the start of the one stderr line) for every refused input."""
    bad = tmp / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q", answer}\n')
    no_number = tmp / "no_number.jsonl"
    no_number.write_text('{"question": "q", "answer": "none"}\n')
    empty_model = tmp / "empty_model"
    empty_model.mkdir()
    a_file = tmp / "a_file"
    a_file.write_text("x")
    earlier = tmp / "earlier"
    missing = tmp / "missing.jsonl"
    hub_id = "Qwen/Qwen3-0.6B"
    return [
        ("data-missing", ["--data", str(missing)],
         f"error: --data {missing}: no such file; fix: "),
        ("data-folder", ["--data", str(tmp)],
         f"error: --data {tmp}: is a folder, not a file; fix: "),
        ("data-malformed-line", ["--data", str(bad)], f"error: --data {bad}:2: not JSON ("),
        ("data-no-answer", ["--data", str(no_number)],
         f"error: --data {no_number}:1: answer states no number"),
        ("model-missing", ["--model", "/nonexistent"],
         "error: --model /nonexistent: no such folder; fix: "),
        ("model-hub-offline", ["--model", hub_id],
         f"error: --model {hub_id}: no such folder, and as a Hugging Face hub id it is not in "
         f"the local cache and the hub is unreachable"),
        ("model-no-config", ["--model", str(empty_model)],
         f"error: --model {empty_model}: {empty_model} holds no config.json"),
        ("out-is-a-file", ["--out", str(a_file)],
         f"error: --out {a_file}: is a file, not a folder; fix: "),
        ("out-earlier-run", ["--out", str(earlier)],
         f"error: --out {earlier}: holds an earlier run (metrics.jsonl, store, sync.png); "
         f"fix: add --overwrite"),
        ("config-missing", ["--config", f"{tmp}/none.yaml"],
         f"config error: config file {tmp}/none.yaml not found"),
        ("config-unknown-key", ["actor.no_such_key=1"],
         "config error: actor.no_such_key=1: unknown key"),
        ("resume-no-checkpoint", ["--resume", str(empty_model)],
         f"error: --resume {empty_model}: no checkpoint"),
        ("cluster-no-scheduler", ["--config", str(CLUSTER)], "error: scheduler.type=None: "),
    ]


def _cli(*args: str, home: Path) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(home)}
    env.pop("GSM8K_DEBUG", None)
    started = time.monotonic()
    completed = subprocess.run([sys.executable, str(APP), *args], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=120, check=False)
    return completed, time.monotonic() - started


def test_each_ordinary_mistake_is_one_line_and_exit_2(tmp_path):
    """Every input problem exits 2 with one stderr line naming the input, what was wrong
    and the fix, no traceback; the model cases answer within MODEL_CHECK_S; and an earlier
    run's --out given with --overwrite is left untouched, since every check comes first."""
    cases = _inputs(tmp_path)
    before = _earlier_run(tmp_path / "earlier")
    failures = []
    for name, args, expected in cases:
        extra = [] if "--out" in args else ["--out", str(tmp_path / "earlier"), "--overwrite"]
        completed, seconds = _cli(*args, *extra, home=tmp_path / "hf")
        lines = completed.stderr.strip().splitlines()
        ok = (2 == completed.returncode and 1 == len(lines) and lines[0].startswith(expected)
              and "fix: " in lines[0] and "Traceback" not in completed.stderr
              and (not name.startswith("model") or seconds < MODEL_CHECK_S))
        if not ok:
            failures.append((name, completed.returncode, round(seconds, 1), completed.stderr))
    assert [] == failures
    assert before == _contents(tmp_path / "earlier")


def test_a_second_job_on_the_same_out_is_refused(tmp_path):
    """While a job holds --out (its run lock), another job on it exits 2, even with
    --overwrite, and writes nothing there."""
    out = tmp_path / "run"
    held = claim_out(out, overwrite=False)  # what a running job holds
    try:
        (out / "metrics.jsonl").write_text('{"version": 1}\n')
        before = _contents(out)
        completed, _ = _cli("--out", str(out), "--overwrite", home=tmp_path / "hf")
    finally:
        held.close()
    assert 2 == completed.returncode
    assert [f"error: --out {out}: another job is writing into this folder; fix: wait for it "
            f"to end, or give another --out folder"] == completed.stderr.strip().splitlines()
    assert before == _contents(out)


def test_debug_shows_the_traceback(tmp_path):
    """--debug (and GSM8K_DEBUG=1) keep exit 2 and add the traceback above the line."""
    for args, env in ((["--debug"], {}), ([], {"GSM8K_DEBUG": "1"})):
        completed = subprocess.run([sys.executable, str(APP), "--data", f"{tmp_path}/x", *args],
                                   cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                                   text=True, timeout=120, check=False)
        assert 2 == completed.returncode
        assert "Traceback (most recent call last)" in completed.stderr
        assert completed.stderr.strip().splitlines()[-1].startswith(f"error: --data {tmp_path}/x")


def test_help_does_not_import_torch():
    """--help answers without importing torch (the job's modules load only once it runs)."""
    code = ("import sys; sys.argv = ['gsm8k_separation', '--help']\n"
            "from gsm8k_separation.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print('torch imported:', 'torch' in sys.modules)")
    completed = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                               text=True, timeout=120, check=True,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                   [str(ROOT / "apps"), os.environ.get("PYTHONPATH", "")])})
    assert completed.stdout.rstrip().endswith("torch imported: False")
    assert "--overwrite" in completed.stdout and "--debug" in completed.stdout


def test_a_worker_failure_is_one_line_and_exit_3(tmp_path):
    """A checkpoint that passes the startup check but cannot be loaded fails in the actor
    process: exit 3, one line with the worker's name and its error, no traceback."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no_such_architecture"}')
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    completed, _ = _cli("--model", str(broken), "--no-progress", home=tmp_path / "hf")
    lines = completed.stderr.strip().splitlines()
    assert 3 == completed.returncode, completed.stderr
    assert "Traceback" not in completed.stderr
    assert lines[-1].startswith("error: ") and "process failed: " in lines[-1]
    assert lines[-1].endswith("(WorkerError; rerun with --debug or GSM8K_DEBUG=1 for the "
                              "traceback)")
