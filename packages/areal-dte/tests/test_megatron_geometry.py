"""The Megatron trainer geometry against megatron-core's own GPTModel, TP 1 and 2 (gloo).

Megatron's optimizers need CUDA, so the detector hooks are checked on a GPU
(``tools/gpu/check_megatron.py``); what a CPU can check is that the layout the change
sets are expressed in is megatron-core's: names, shapes, and index remapping into
SGLang's layout agreeing with a dense conversion.
"""

import multiprocessing

import pytest
from group_worker import finish, rendezvous
from megatron_world import DENSE, MOE, run

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]


@pytest.mark.parametrize(("config", "trainer_tp", "rollout_tp"), [
    pytest.param(DENSE, 1, 2, id="dense-tp1-to-sglang-tp2"),
    pytest.param(DENSE, 2, 1, id="dense-tp2-to-sglang-tp1"),
    pytest.param(MOE, 2, 2, id="moe-tp2-to-sglang-tp2"),
])
def test_change_sets_remap_like_dense_tensors(config, trainer_tp, rollout_tp, tmp_path):
    """On every TP rank: the GPTModel's params are the layout's tensors (names, shapes),
    and remapped change sets give the bytes of the dense conversion of the new weights."""
    context = multiprocessing.get_context("spawn")
    init = rendezvous(tmp_path)
    procs = [context.Process(target=run, args=(rank, trainer_tp, init, config, rollout_tp,
                                               str(tmp_path))) for rank in range(trainer_tp)]
    for proc in procs:
        proc.start()
    hung, codes = finish(procs, 240)
    assert ([], [0] * trainer_tp) == (hung, codes)
    for rank in range(trainer_tp):
        assert ["names and shapes equal: True", "changed elements: True",
                "changes remapped equal dense: True"] == (
            tmp_path / f"rank{rank}.log").read_text().splitlines()
