"""batch.plan: which tensors share a kernel launch, and the tables that locate them."""

from __future__ import annotations

import torch

from dte_detector import batch


def _members(*sizes: int, offset: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Flat fp32 tensors of ``sizes`` (two kinds each), views ``offset`` elements into one
    16-byte-aligned buffer per kind."""
    total = sum(sizes) + 4 * len(sizes) + offset
    buffers = [torch.zeros(total + 16, dtype=torch.float32) for _ in range(2)]
    shift = [(-b.data_ptr() % 16) // 4 for b in buffers]
    members, at = [], offset
    for size in sizes:
        members.append(tuple(b[s + at:s + at + size] for b, s in zip(buffers, shift)))
        at += -(-size // 4) * 4  # next member on a 16-byte boundary
    return members


def test_one_group_per_key_with_tables_of_first_tiles_sizes_and_offsets():
    """Members of one key share a group: each starts on its own tile, the starts end with
    the tile count and padding, and the offsets address each member from the first."""
    members = _members(1, 1024, 1025, 3)
    (group,) = batch.plan(members, ["k"] * 4, tile_elements=1024)
    assert (0, 1, 2, 3) == group.members
    assert 5 == group.tiles
    assert [0, 1, 2, 4, 5] == group.starts.tolist()[:5]
    assert all(s > 2**60 for s in group.starts.tolist()[5:])
    assert 8 == group.starts.numel()  # 2**steps entries, at least one past the count
    assert [1, 1024, 1025, 3, 0] == group.numels.tolist()
    expected = [[(m[k].data_ptr() - members[0][k].data_ptr()) // 4 for m in members] + [0]
                for k in range(2)]
    assert expected == group.offsets.tolist()
    assert group.aligned
    assert torch.int32 == group.index_dtype


def test_keys_alignment_and_the_size_budget_split_groups(monkeypatch):
    """Different keys never share a group; a member off a 16-byte boundary goes to an
    unaligned group; a group stops before it would pass GROUP_ELEMENTS, and a member
    larger than that is a group of its own."""
    monkeypatch.setattr(batch, "GROUP_ELEMENTS", 2048)
    aligned = _members(1000, 1000, 1000, 5000)
    unaligned = _members(8, offset=1)
    groups = batch.plan([*aligned, *unaligned], ["a", "b", "a", "a", "a"], tile_elements=1024)
    assert [((0, 2), "a", True), ((3,), "a", True), ((1,), "b", True), ((4,), "a", False)] == [
        (g.members, g.key, g.aligned) for g in groups]
