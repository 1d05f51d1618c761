"""Cluster mode on AReaL 1.0.4's awex path, on gloo: the Delta adapters against each other.

AReaL's real awex pieces run here: its two adapters (subclassed), its KV-store gateway,
its ``fetch_kv_metadata`` and serialization, awex 0.7.0's ``TransferPlanBuilder``; the
rollout ranks hold SGLang 0.5.10.post1's own Qwen3 / Qwen3-MoE models. What stands in,
and why, is in ``awex_world``'s docstring (Megatron's optimizer and SGLang's scheduler:
they need a GPU).

Each case runs 16 versions of AdamW steps from a megatron-core GPTModel at TP2 to SGLang
models (started from SGLang's own load of the initial weights, at a vocab SGLang pads),
with a delta vetoed by a rollout rank that holds another base (version 4), a delta whose
payload is refused after the exchange (version 6), a rollout rank whose live params no
longer fit its shard (version 8: no rank writes, the next version is full), an anchor
(after 4 deltas) and a rollout rank that restarts empty and reconnects (version 15);
after every version every rollout rank compares every element, as bits, with a full
sync of that version (of the one before, where it refused).
"""

import json
import multiprocessing
import re
import socket
import threading
import time

import attrs
import pytest
from awex_world import PAIRS, TRAINER_TP, Case, run_rollout, run_trainer, write_json
from dte_config import DeltaMethod
from group_worker import finish, rendezvous, stop
from megatron_world import DENSE, MOE

pytestmark = [pytest.mark.areal, pytest.mark.distributed]

ADMIN = {"Authorization": "Bearer areal-admin-key"}
"""AReaL's default admin key of the gateway (``WeightUpdateConfig.admin_api_key``)."""

MISFIT = "name: expected a tensor of the receiver, got 'model.embed_tokens.weight'"
"""Rollout rank 0's refusal of v8, whose live params no longer fit its shard."""
TRAINER_LOG = [
    "v1 full no_base", "v2 delta delta", "v3 delta delta", "v4 full base_mismatch",
    "v5 delta delta", "v6 full delta_rejected: bad_payload: rank 0: body_digest: expected "
    "0x…, got 0x…", "v7 delta delta",
    "v8 SyncError: version 8 was not delivered: full sync rejected by a rollout rank "
    f"(mismatch): rank 0: {MISFIT}; the next sync is full",
    "v9 full no_base", "v10 delta delta", "v11 delta delta", "v12 delta delta",
    "v13 delta delta", "v14 anchor anchor_due", "v15 full no_base", "v16 delta delta",
]
"""What every trainer rank reports per version: the veto at the agreement (v4), the
delta refused at the vote and sent again in full (v6), a version no rollout could take
(v8: a rank's live params no longer fit) and the full sync after it, the anchor after
four deltas, the full sync after the reconnect."""
REFUSED = ("v8 PayloadRejectedError: payload rejected (mismatch): {}; holding version {}, "
           "flushed 0, bitwise equal to a full sync (the version before)")
"""Every rollout rank's v8: refused, written nothing, still the bits of v7."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _gateway():
    """AReaL's weight-update gateway app on a local port (its KV store is what we use)."""
    import uvicorn
    from areal.experimental.weight_update.gateway.app import create_app

    server = uvicorn.Server(uvicorn.Config(create_app(), host="127.0.0.1", port=_free_port(),
                                           log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{server.config.port}"


def _publish_metas(folder, case: Case, url: str, procs, seconds: float = 300) -> None:
    """As the gateway's ``/connect``: training metas merged by name, inference metas in
    rank order, into the KV store of each pair; then tell the ranks where to connect."""
    import httpx
    from areal.experimental.weight_update.gateway.app import _merge_training_meta_by_name

    names = [f"infer{r}" for r in range(case.rollouts)] + [
        f"train{t}" for t in range(TRAINER_TP)]
    deadline = time.monotonic() + seconds
    while not all((folder / f"meta-{n}.json").exists() for n in names):
        assert time.monotonic() < deadline, "ranks did not report their metas"
        assert all(p.is_alive() or p.exitcode == 0 for p in procs), "a rank died"
        time.sleep(0.1)
    metas = {n: json.loads((folder / f"meta-{n}.json").read_text()) for n in names}
    infer = [m for n in names if n.startswith("infer") for m in metas[n]]
    train = _merge_training_meta_by_name([m for n in names if n.startswith("train")
                                          for m in metas[n]])
    for pair in PAIRS:
        for key, value in (("infer_params_meta", infer), ("training_params_meta", train)):
            httpx.put(f"{url}/weight_meta/{pair}/{key}", json={"value": value},
                      headers=ADMIN).raise_for_status()
        # atomically: a rank polls for this file and would read it half written
        write_json(str(folder / f"connect-{pair}.json"), {"port": _free_port(), "kv": url})


PADDED_VOCAB = 120
"""A vocab that Megatron splits as is and SGLang pads (to 128 rows, a multiple of 64): the
rollout's embedding and lm_head rows past it are padding, which no sync writes."""


@pytest.mark.parametrize("case", [
    pytest.param(Case(attrs.evolve(DENSE, vocab=PADDED_VOCAB), rollout_tp=2, engines=1,
                      method=DeltaMethod.CAST),
                 id="qwen3-megatron-tp2-cast-to-sglang-tp2"),
    pytest.param(Case(attrs.evolve(MOE, vocab=PADDED_VOCAB), rollout_tp=1, engines=2,
                      method=DeltaMethod.ADAMW),
                 id="qwen3moe-megatron-tp2-adamw-to-2-engines-sglang-tp1"),
])
def test_every_rollout_rank_equals_a_full_sync_every_version(case, tmp_path):
    """Every rollout rank holds, after every version, the bits a full sync gives, and
    flushed its cache once per version (a rank whose scheduler is not idle raises after
    the group's collectives); the trainers report the delta, the refusals answered in
    full, the anchor and the reconnect as `TRAINER_LOG`."""
    server, url = _gateway()
    context = multiprocessing.get_context("spawn")
    trainer_store, rollout_store = rendezvous(tmp_path), rendezvous(tmp_path)
    procs = [context.Process(target=run_rollout, args=(r, case, rollout_store, str(tmp_path)))
             for r in range(case.rollouts)]
    procs += [context.Process(target=run_trainer, args=(t, case, trainer_store, str(tmp_path)))
              for t in range(TRAINER_TP)]
    for proc in procs:
        proc.start()
    try:
        _publish_metas(tmp_path, case, url, procs)
        hung, codes = finish(procs, 200)
    finally:
        stop(procs)
        server.should_exit = True
    assert ([], [0] * len(procs)) == (hung, codes)
    for t in range(TRAINER_TP):
        logged = (tmp_path / f"train{t}.log").read_text().splitlines()
        assert TRAINER_LOG == [re.sub(r"0x[0-9a-f]{16}", "0x…", line) for line in logged]
    applied = [f"v{v} applied, flushed 1, bitwise equal to a full sync"
               for v in range(1, case.versions + 1)]
    for r in range(case.rollouts):
        expected = list(applied)
        expected[case.replaced - 1] = REFUSED.format(MISFIT, None) if r == 0 else (
            REFUSED.format(f"another rollout rank rejected this version: rank 0: {MISFIT}", 7))
        if r == case.rollouts - 1:
            expected[case.busy - 1] = (
                f"v{case.busy} DeltaSyncError: KV cache flush after the update: expected an "
                "idle scheduler, got requests still held, flushed 1, bitwise equal to a full sync")
        assert expected == (tmp_path / f"infer{r}.log").read_text().splitlines()
