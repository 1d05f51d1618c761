"""Multi-process group sync over real gloo process groups: Megatron-layout trainer ranks
send to SGLang-layout rollout ranks, every version bitwise equal to a full sync."""

from __future__ import annotations

import time

import pytest
from areal_dte import Method
from dte_codec.layouts import ModelConfig
from dte_codec.megatron_layout import MegatronLayout
from dte_codec.sglang_layout import SGLangLayout
from group_worker import Case, finish, ranks, rendezvous, run

pytestmark = [pytest.mark.distributed, pytest.mark.processes]

DENSE = ModelConfig(vocab=64, hidden=16, layers=2, heads=4, kv_heads=2, head_dim=4,
                    intermediate=32)
MOE = ModelConfig(vocab=64, hidden=16, layers=2, heads=4, kv_heads=2, head_dim=4,
                  num_experts=4, moe_intermediate=8)
PADDED = ModelConfig(vocab=50, hidden=16, layers=2, heads=4, kv_heads=2, head_dim=4,
                     intermediate=32)
"""A vocab that SGLang pads (to 64 rows per rank at TP2): rows that no trainer sends."""
JOIN_SECONDS = 240


def launch(case: Case, tmp_path, *, replace_rank: int | None = None) -> dict[str, list[str]]:
    """Run every rank of ``case`` in its own process (``ranks()``); return each rank's log.

    With ``replace_rank``, once that rank's process has exited a replacement starts and
    the survivors re-form the group with it through a second rendezvous file.
    """
    context = ranks()
    store, rejoin = rendezvous(tmp_path), rendezvous(tmp_path)
    procs = [context.Process(target=run, args=(rank, case, store, str(tmp_path)),
                             kwargs={"rejoin": rejoin if replace_rank is not None else None})
             for rank in range(case.world)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + JOIN_SECONDS
    if replace_rank is not None:
        procs[replace_rank].join(JOIN_SECONDS)
        replacement = context.Process(target=run, args=(replace_rank, case, rejoin,
                                                        str(tmp_path)),
                                      kwargs={"rejoin": rejoin, "replacement": True})
        replacement.start()
        procs.append(replacement)
    hung, codes = finish(procs, max(1.0, deadline - time.monotonic()))
    assert [] == hung, "ranks hung"
    assert [0] * len(procs) == codes
    return {path.stem: path.read_text().splitlines() for path in tmp_path.glob("rank*.log")}


LAYOUTS = [
    pytest.param(DENSE, MegatronLayout(tp=2), SGLangLayout(tp=1), Method.ADAMW,
                 id="dense-megatron-tp2-to-sglang-tp1-adamw"),
    pytest.param(DENSE, MegatronLayout(tp=1), SGLangLayout(tp=2), Method.CAST,
                 id="dense-megatron-tp1-to-sglang-tp2-cast"),
    pytest.param(DENSE, MegatronLayout(tp=2), SGLangLayout(tp=4), Method.ADAMW,
                 id="dense-megatron-tp2-to-sglang-tp4-adamw"),
    pytest.param(PADDED, MegatronLayout(tp=2), SGLangLayout(tp=2), Method.ADAMW,
                 id="padded-vocab-megatron-tp2-to-sglang-tp2-adamw"),
    pytest.param(MOE, MegatronLayout(ep=2), SGLangLayout(tp=1), Method.CAST,
                 id="moe-megatron-ep2-to-sglang-tp1-cast-fp32-router"),
]


@pytest.mark.parametrize(("config", "trainer", "rollout", "method"), LAYOUTS)
def test_versions_bitwise_equal_a_full_sync(config, trainer, rollout, method, tmp_path):
    """12 versions of real AdamW steps with anchors every 4 deltas: every rollout rank
    holds exactly the bf16 (router: fp32) weights a full sync gives, every version."""
    logs = launch(Case(config, trainer, rollout, method=method, versions=12, anchor=4),
                  tmp_path)
    trainer_log = logs["rank0"]
    assert "v1 full no_base" in trainer_log[0]
    kinds = [line.split()[2] for line in trainer_log]
    assert ["full"] + ["delta"] * 4 + ["anchor"] + ["delta"] * 4 + ["anchor", "delta"] == kinds
    for rank in range(trainer.world_size, trainer.world_size + rollout.world_size):
        assert ["bitwise equal"] * 12 == [line.split(" ", 2)[2] for line in logs[f"rank{rank}"]]


@pytest.mark.parametrize("fault", ["corrupt", "wrong_base", "restart"])
def test_faults_fall_back_to_a_full_sync(fault, tmp_path):
    """A corrupted body, a rollout rank on the wrong base or restarted empty: the delta
    is refused or vetoed, the same version goes full, and every version stays exact; a
    refusal's reason (here the rollout's body digest check) reaches the trainer."""
    case = Case(DENSE, MegatronLayout(tp=2), SGLangLayout(tp=2), versions=7, anchor=0,
                fault=fault)
    logs = launch(case, tmp_path)
    kinds = [line.split(" ", 2)[2] for line in logs["rank0"]]
    fallback = {"corrupt": "full delta_rejected: bad_payload: rank 2: body_digest: expected ",
                "wrong_base": "full base_mismatch", "restart": "full rollout_veto"}[fault]
    at = 4 if fault == "wrong_base" else 5
    assert kinds[at - 1].startswith(fallback)
    assert all(k.startswith("delta") for i, k in enumerate(kinds[1:], 2) if i != at)
    for rank in (2, 3):
        assert ["bitwise equal"] * 7 == [line.split(" ", 2)[2] for line in logs[f"rank{rank}"]]


def test_dead_peer_raises_typed_errors_then_rejoin_syncs_full(tmp_path):
    """A rollout rank dies inside version 3's exchange: the trainers raise SyncError and the other
    rollout rank LinkError within the group's timeout, its weights unchanged. The
    survivors re-form the group with a replacement that starts empty: version 4 goes in
    full, version 5 and 6 as deltas, all bitwise equal."""
    case = Case(DENSE, MegatronLayout(tp=2), SGLangLayout(tp=2), versions=6, anchor=0,
                fault="kill_rollout")
    logs = launch(case, tmp_path, replace_rank=2)
    for rank in (0, 1):
        outcomes = [line.split(" ", 2)[2] for line in logs[f"rank{rank}"]]
        assert outcomes[2].startswith("SyncError")
        assert ["full no_base", "delta delta", "delta delta"] == outcomes[3:]
    assert ["bitwise equal"] * 2 + ["LinkError, unchanged"] + ["bitwise equal"] * 3 == [
        line.split(" ", 2)[2] for line in logs["rank3"]]
    assert ["bitwise equal"] * 3 == [line.split(" ", 2)[2] for line in logs["rank2-replacement"]]


def test_full_syncs_in_small_windows(tmp_path):
    """Windows of 256 bytes: every full sync and anchor goes in many rounds of boxes cut
    into rows, each window checked and written as it comes; every version bitwise."""
    case = Case(DENSE, MegatronLayout(tp=2), SGLangLayout(tp=2), versions=4, anchor=1,
                window=256)
    logs = launch(case, tmp_path)
    assert ["full", "delta", "anchor", "delta"] == [line.split()[2] for line in logs["rank0"]]
    for rank in (2, 3):
        assert ["bitwise equal"] * 4 == [line.split(" ", 2)[2] for line in logs[f"rank{rank}"]]


def test_refused_window_leaves_no_version_then_a_full_sync_recovers(tmp_path):
    """A body byte flips in the second window round of the first full sync: the refusing
    rollout's reason reaches the trainers (``SyncError``), every rollout rank that had
    written a window holds no version, and the next sync goes full and is exact."""
    case = Case(DENSE, MegatronLayout(tp=2), SGLangLayout(tp=2), versions=3, anchor=0,
                window=256, fault="corrupt_full")
    logs = launch(case, tmp_path)
    for rank in (0, 1):
        outcomes = [line.split(" ", 2)[2] for line in logs[f"rank{rank}"]]
        assert ["SyncError LinkError", "full no_base", "delta delta"] == outcomes
    for rank in (2, 3):
        assert (["refused bad_payload, version None"] + ["bitwise equal"] * 2
                == [line.split(" ", 2)[2] for line in logs[f"rank{rank}"]])


def test_per_op_point_to_point_and_pipeline_stages(tmp_path):
    """The per-op variant (no coalescing) with a two-stage pipeline on the trainer side."""
    case = Case(DENSE, MegatronLayout(tp=1, pp=2), SGLangLayout(tp=2), versions=5,
                coalesce=False)
    logs = launch(case, tmp_path)
    for rank in (2, 3):
        assert ["bitwise equal"] * 5 == [line.split(" ", 2)[2] for line in logs[f"rank{rank}"]]
