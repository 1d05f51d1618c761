"""The Megatron trainer geometry against megatron-core's own GPTModel, TP 1 and 2 (gloo).

Megatron's optimizers need CUDA, so the detector hooks are checked on a GPU
(``tools/gpu/check_megatron.py``); what a CPU can check is that the layout the change
sets are expressed in is megatron-core's: names, shapes, and index remapping into
SGLang's layout agreeing with a dense conversion.
"""


import pytest
from group_worker import finish, ranks, rendezvous
from megatron_world import DENSE, MOE, run, run_union

pytestmark = [pytest.mark.megatron, pytest.mark.distributed, pytest.mark.processes]


def spawn(target, world: int, *args, tmp_path) -> None:
    """Run ``target(rank, world, rendezvous, *args, log_dir)`` on ``world`` gloo ranks."""
    context = ranks()
    init = rendezvous(tmp_path)
    procs = [context.Process(target=target, args=(rank, world, init, *args, str(tmp_path)))
             for rank in range(world)]
    for proc in procs:
        proc.start()
    hung, codes = finish(procs, 240)
    assert ([], [0] * world) == (hung, codes)


@pytest.mark.parametrize(("config", "trainer_tp", "rollout_tp"), [
    pytest.param(DENSE, 1, 2, id="dense-tp1-to-sglang-tp2"),
    pytest.param(DENSE, 2, 1, id="dense-tp2-to-sglang-tp1"),
    pytest.param(MOE, 2, 2, id="moe-tp2-to-sglang-tp2"),
])
def test_change_sets_remap_like_dense_tensors(config, trainer_tp, rollout_tp, tmp_path):
    """On every TP rank: the GPTModel's params are the layout's tensors (names, shapes),
    and remapped change sets give the bytes of the dense conversion of the new weights."""
    spawn(run, trainer_tp, config, rollout_tp, tmp_path=tmp_path)
    for rank in range(trainer_tp):
        assert ["names and shapes equal: True", "changed elements: True",
                "changes remapped equal dense: True"] == (
            tmp_path / f"rank{rank}.log").read_text().splitlines()


@pytest.mark.parametrize(("world", "window_bytes"), [(2, 512 * 2**20), (3, 200)])
def test_dp_union_merges_the_ranks_ranges(world, window_bytes, tmp_path):
    """Each DP rank's change sets of its own ranges, merged over the group (one window, or
    many small ones with a param larger than the window), are the whole change sets:
    indices sorted, bounds bit for bit, index dtype kept."""
    spawn(run_union, world, window_bytes, tmp_path=tmp_path)
    for rank in range(world):
        assert ["union equals the whole change sets: True"] == (
            tmp_path / f"rank{rank}.log").read_text().splitlines()
