"""The app's command line: the seed's cluster config validates in a dry run, and a
configuration the delta path cannot honour stops the job at startup."""

from pathlib import Path

from gsm8k_separation.cli import main

CLUSTER = Path(__file__).resolve().parents[1] / "apps/gsm8k_separation/configs/gsm8k_grpo_qwen3_30b_a3b.yaml"


def test_cluster_config_dry_run_prints_the_resolved_config(capsys):
    """--dry-run validates the seed's Qwen3-30B-A3B config, prints it resolved, exits 0."""
    assert 0 == main(["--config", str(CLUSTER), "--dry-run"])
    out = capsys.readouterr().out
    assert "backend: megatron:(attn:d2p1t4|ffn:d1p1e8)" in out
    assert "weight_update_anchor_interval: 20" in out


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
    assert capsys.readouterr().err.startswith("config error: scheduler.type=None: ")


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
