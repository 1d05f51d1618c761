"""batch.plan: which tensors share a kernel launch, and the tables that locate them (kept
by ``layout.Fused``)."""

from __future__ import annotations

import torch

from dte_detector import batch, layout


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
    assert [((0, 2), True), ((3,), True), ((1,), True), ((4,), False)] == [
        (g.members, g.aligned) for g in groups]


def test_a_kept_plan_serves_other_keys_of_one_pattern_and_follows_the_tile_size():
    """``layout.Fused.groups`` keeps its plan while the key pattern and the tile size stay:
    the same groups (no table built or copied) whatever the keys; another pattern, or
    another tile size (``tools/gpu/tune_kernels.py`` sets one per candidate), is planned
    anew, and so is every call for members that are not contiguous (they are copies)."""
    members = _members(1000, 3000, 5)
    fused = layout.Fused([0, 1, 2], True, True)
    first = fused.groups(members, ["a", "b", "a"], tile_elements=1024)
    assert [(0, 2), (1,)] == [g.members for g in first]
    assert first is fused.groups(members, ["c", "d", "c"], tile_elements=1024)
    merged = fused.groups(members, ["c", "c", "c"], tile_elements=1024)
    assert [(0, 1, 2)] == [g.members for g in merged]
    assert [0, 1, 4, 5] == merged[0].starts.tolist()[:4]
    assert [0, 3, 4] == merged[0].lasts.tolist()
    assert 3000 == merged[0].numel
    smaller = fused.groups(members, ["c", "c", "c"], tile_elements=512)
    assert [0, 2, 8, 9] == smaller[0].starts.tolist()[:4]
    assert smaller is fused.groups(members, ["c", "c", "c"], tile_elements=512)
    copied = layout.Fused([0, 1, 2], True, False)
    assert copied.groups(members, ["a"] * 3, tile_elements=1024) is not copied.groups(
        members, ["a"] * 3, tile_elements=1024)


def test_tables_follow_a_replaced_or_resized_member():
    """A member's tensor replaced by one elsewhere in memory, or resized: the plan's
    tables hold the new offsets and tiles (``layout`` decides when to plan again)."""
    members = _members(1000, 3000, 5)
    moved = [members[0], tuple(t.clone() for t in members[1]), members[2]]
    replaced = batch.plan(moved, ["a"] * 3, tile_elements=1024)
    expected = [(t.data_ptr() - moved[0][k].data_ptr()) // 4
                for k, t in enumerate(moved[1])]
    assert expected == replaced[0].offsets[:, 1].tolist()
    resized = [members[0], tuple(t[:2500] for t in members[1]), members[2]]
    (group,) = batch.plan(resized, ["a"] * 3, tile_elements=1024)
    assert [0, 1, 4, 5] == group.starts.tolist()[:4]
    assert [1000, 2500, 5] == group.numels.tolist()[:3]


def test_key_ids_number_distinct_keys_in_order_of_first_appearance():
    """Equal keys get one number whether or not they are one object; the numbers follow
    first appearance."""
    a, b = ("x", 1), ("y", 2)
    assert (0, 0, 1, 0, 1, 2) == batch.key_ids([a, a, b, ("x", 1), b, "z"])


def test_every_table_starts_on_a_16_byte_boundary():
    """Groups of odd and even member counts: each table of each group starts on a 16-byte
    boundary (a kernel specialised on an aligned table is not compiled again for a table
    at another offset)."""
    members = _members(*range(1, 40, 3))
    groups = batch.plan(members, [i % 3 for i in range(len(members))], tile_elements=1024)
    tables = [t for g in groups for t in (g.starts, g.numels, g.offsets, g.lasts)]
    assert [0] * len(tables) == [t.data_ptr() % batch.VECTOR_BYTES for t in tables]
