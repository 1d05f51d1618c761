"""block_owners: the block -> segment table from packed int32 counts equals
``fields.block_segments``'s."""

import numpy as np
import pytest
import torch
from dte_codec.block_owners import owners, packed
from dte_codec.fields import block_segments, host_tables


@pytest.mark.parametrize("blocks", [[], [0], [3], [2, 0, 5, 1], [0, 0, 4, 0], [1] * 7,
                                    list(range(12))])
def test_owners_equal_block_segments(blocks):
    """Every block gets the segment ``fields.block_segments`` gives it (empty segments,
    odd and even segment counts), as int32."""
    counts = np.array(blocks, dtype=np.int64)
    total = int(counts.sum())
    row, = host_tables([packed(counts)], torch.device("cpu"))
    expected = block_segments(torch.from_numpy(counts), total)
    got = owners(row, counts.size, total)
    assert (expected.dtype, expected.tolist()) == (got.dtype, got.tolist())
