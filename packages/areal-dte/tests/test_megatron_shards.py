"""MainShard: the view the Megatron cast hook writes through.

Seen on an H200 with megatron-core 0.17.0: while the hook wrote through a ``detach()``
view, the torch path of that write moved the param's version counter, and the detector
took its own copy for a write from outside (needless full syncs). Writes through the
shard's view must leave the counter alone; a write through the param must move it.
"""

import torch
from areal_dte.megatron.shards import MainShard
from dte_detector import CastDetector


def test_the_hooks_copy_leaves_the_version_counter_a_load_moves_it():
    """``record_and_copy`` into ``MainShard.model`` writes the param's range and keeps its
    version; ``param.copy_`` (what ``load_state_dict`` does) moves it."""
    param = torch.nn.Parameter(torch.randn(64).bfloat16(), requires_grad=False)
    main = torch.randn(32)
    shard = MainShard("w", main, param, 16)
    version = param._version
    CastDetector().record_and_copy("w", main, shard.model)
    assert (True, version) == (torch.equal(param.data[16:48], main.bfloat16()), param._version)
    with torch.no_grad():
        param.copy_(torch.zeros(64))
    assert version != param._version
