"""``encode_plan`` and ``encoding_choice``: the flat encoder's encodings, entries and layout
for all tensors at once equal what the per-tensor rules give, tensor by tensor (sizes from
``Entry``'s own ``section_sizes``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from dte_codec.encode_plan import plan, tensor_table
from dte_codec.encoding_choice import choose_indices, choose_value_encodings
from dte_codec.encodings import ALIGNMENT, IndexEncoding, ValueEncoding, align
from dte_codec.entry import Entry

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.uint8)
BINS = 32


@st.composite
def tensors(draw):
    """A tensor's dtype, numel and change count, gaps over a byte, and a histogram of
    residue widths (those of its dtype only) summing to the count."""
    dtype = draw(st.sampled_from(DTYPES))
    numel = draw(st.integers(1, 64) | st.integers(1, 2**34))
    count = draw(st.integers(1, min(numel, 5000)))
    bits = torch.empty((), dtype=dtype).element_size() * 8
    widths = draw(st.lists(st.integers(1, bits), min_size=count, max_size=count))
    hist = np.bincount(widths, minlength=BINS + 1)[:BINS]
    return dtype, numel, count, draw(st.integers(0, count)), hist


def _smallest_values(entry: Entry, hist: np.ndarray) -> Entry:
    """Every residue width tried by building its entry; the first smallest kept."""
    best = entry
    for width in range(1, entry.itemsize * 8):
        escapes = entry.count - int(hist[:width + 1].sum())
        candidate = Entry(name=entry.name, dtype=entry.dtype, shape=entry.shape,
                          count=entry.count, value_encoding=ValueEncoding.RESIDUE,
                          value_width=width, value_escapes=escapes)
        if sum(candidate.value_sections()) < sum(best.value_sections()):
            best = candidate
    return best


def _reference_entry(name, dtype, numel, count, gap_escapes, hist) -> Entry:
    raw = Entry(name=name, dtype=dtype, shape=(numel,), count=count)
    value = _smallest_values(raw, hist) if dtype in (torch.bfloat16, torch.float16,
                                                     torch.float32) else raw
    sparse = Entry(name=name, dtype=dtype, shape=(numel,), count=count,
                   **choose_indices(count, numel, gap_escapes=gap_escapes),
                   value_encoding=value.value_encoding, value_width=value.value_width,
                   value_escapes=value.value_escapes)
    if sum(sparse.section_sizes()) >= numel * raw.itemsize:
        return Entry(name=name, dtype=dtype, shape=(numel,), count=numel)
    return sparse


@given(st.lists(tensors(), min_size=1, max_size=8))
@example([(torch.uint8, 8, 8, 0, np.zeros(BINS, dtype=np.int64)),  # dense
          (torch.bfloat16, 600, 600, 0, np.eye(BINS, dtype=np.int64)[1] * 600),
          (torch.float32, 2**33, 1, 1, np.eye(BINS, dtype=np.int64)[31]),
          (torch.uint8, 3, 2, 0, np.zeros(BINS, dtype=np.int64))])
def test_plan_equals_the_per_tensor_rules(rows):
    """Entries, dense offsets and body size of a mixed batch (dtypes of 1 to 4 bytes, the
    histograms as wide as the widest dtype) are the per-tensor rules' exactly."""
    names = [f"t{i}" for i in range(len(rows))]
    table = tensor_table(tuple((n, r[0], (r[1],)) for n, r in zip(names, rows)))
    chosen = plan(table, np.array([r[2] for r in rows]),
                  gap_escapes=np.array([r[3] for r in rows]),
                  hist=np.stack([r[4] for r in rows]), device=torch.device("cpu"))
    expected = [_reference_entry(n, *r) for n, r in zip(names, rows)]
    assert expected == list(chosen.entries())
    offsets, at = [], 0
    for entry in expected:
        dense = entry.index_encoding == IndexEncoding.DENSE
        offsets.append(at if dense else -1)
        at += sum(align(s) for s in entry.section_sizes())
    assert offsets == chosen.layout.dense_offsets.tolist()
    assert at == chosen.layout.size and at % ALIGNMENT == 0


@pytest.mark.parametrize(("need", "expected"), [
    (3, (ValueEncoding.RESIDUE, 3)),  # widths 3..8 all take one byte: the narrowest
    (9, (ValueEncoding.RAW, 0)),  # two bytes, as many as the raw value: raw
])
def test_value_choice_ties(need, expected):
    """Equal sizes go to the narrower width, and to RAW over a residue (strict ``<``)."""
    hist = np.zeros((1, 16), dtype=np.int64)
    hist[0, need] = 1
    chosen = choose_value_encodings(np.array([1]), np.array([2]), np.array([True]), hist)
    assert expected == (chosen.encoding[0], chosen.width[0])
