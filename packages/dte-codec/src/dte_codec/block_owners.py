"""Block -> segment tables of the receiver's kernels, from block counts that go to the
device with a payload's entry table anyway.

``fields.block_segments`` makes such a table from a device column of int64 counts: an
``arange`` of the segments, a prefix sum (two launches), a fill and a gather, five device
ops. Shipped as int32 in the same host-to-device copy as the table (``packed``: two to
an int64 word), the counts make it with ``torch.repeat_interleave`` of the counts alone,
whose output is each block's segment (its count's position): three device ops, no
``arange`` and no gather, and the same int32 table.
"""

from __future__ import annotations

import numpy as np
import torch


def packed(blocks: np.ndarray) -> np.ndarray:
    """Per segment its block count as int32, two to an int64 word: a row to copy with
    ``fields.host_tables``. A launch has fewer than 2**31 blocks in all, so each count
    fits."""
    out = np.zeros(max(-(-blocks.size // 2), 1), dtype=np.int64)
    out.view(np.int32)[:blocks.size] = blocks
    return out


def owners(row: torch.Tensor, segments: int, total: int) -> torch.Tensor:
    """Per block of ``total``, the segment that owns it (int32; ``fields.block_segments``)
    from ``row``, a ``packed`` row of ``segments`` counts on the device."""
    return torch.repeat_interleave(row.view(torch.int32)[:segments], output_size=total)
