"""FA3's row groups for a step on fewer SMs (backends/runtime/attention/sm_partition.py): the groups' work items, and
each group's page layout giving its rows the same attention as the whole step (the reference backend on the CPU)."""
from __future__ import annotations

import random

import pytest
import torch

from backends.runtime.attention import AttentionMetadata, TorchAttentionBackend
from backends.runtime.attention.sm_partition import group_layout, group_rows, row_groups, tile_rows
from backends.runtime.language_model.kv_cache import pages_needed

PAGE_SIZE, KV_HEADS, HEADS, HEAD_DIM, PAGES = 4, 2, 6, 8, 400


@pytest.mark.parametrize("qo_lens,heads,head_dim,sms", [
    ([2048], 28, 128, 120),  # the 7B's video chunk on encode_prefill's green context: 4 tiles a group
    ([117] * 15, 28, 128, 120),  # a burst of text prompts: each one tile
    ([300, 1, 900, 129], 40, 128, 104),  # InternVL3-38B's 40 heads: 2 tiles a group
    ([1000], 2, 64, 100),  # head_dim 64: tiles of 192 rows
    ([500], 28, 128, 20),  # fewer SMs than heads: still one tile a group
])
def test_groups_cover_the_rows_in_order_within_the_sms(qo_lens, heads, head_dim, sms):
    tile = tile_rows(head_dim)
    groups = row_groups(qo_lens, heads, head_dim, sms)
    flat = [piece for group in groups for piece in group]
    for seq, n in enumerate(qo_lens):  # each sequence's rows exactly once, in order, cut at whole tiles
        pieces = [(start, end) for s, start, end in flat if s == seq]
        assert pieces[0][0] == 0 and pieces[-1][1] == n
        assert all(a[1] == b[0] and a[1] % tile == 0 for a, b in zip(pieces, pieces[1:]))
    assert [s for s, _, _ in flat] == sorted(s for s, _, _ in flat)
    for group in groups:
        items = heads * sum(-(-(end - start) // tile) for _, start, end in group)
        assert items <= max(sms, heads)
    if sms >= heads:  # every group but the last is full
        assert all(heads * sum(-(-(e - s) // tile) for _, s, e in g) == heads * (sms // heads) for g in groups[:-1])


def test_fewer_than_one_sm_is_refused():
    with pytest.raises(ValueError, match="sms must be at least 1"):
        row_groups([10], 4, 128, 0)


def _step(new: list[int], cached: list[int], rng: random.Random):
    pages = list(range(PAGES))
    rng.shuffle(pages)
    tables, at = [], 0
    for n, c in zip(new, cached):
        k = pages_needed(n + c, PAGE_SIZE)
        tables.append(pages[at:at + k])
        at += k
    return AttentionMetadata.build(new, cached, tables, PAGE_SIZE, "cpu")


@pytest.mark.parametrize("new,cached,heads_per_group", [
    ([40], [90], 1),  # one chunk over a cached prefix, groups of 8 rows (tile 8 below)
    ([13, 1, 30, 9], [0, 17, 50, 3], 2),  # ragged chunks, a decode row among them; groups span sequences
    ([25, 25], [0, 0], 3),  # first chunks: causal within the chunk only
])
def test_each_groups_layout_attends_as_the_whole_step(monkeypatch, new, cached, heads_per_group):
    """Group rows (sm_partition.group_rows) through their own layout (group_layout), with the reference backend,
    equal the same rows of the whole step: each piece's KV ends where its last row's does, and the causal mask does
    the rest; the groups' rows are the step's, each once, in order."""
    monkeypatch.setattr("backends.runtime.attention.sm_partition.tile_rows", lambda head_dim: 8)
    rng = random.Random(sum(new))
    torch.manual_seed(len(new))
    cache = torch.randn(1, 2, PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    metadata = _step(new, cached, rng)
    total = sum(new)
    q, k, v = (torch.randn(total, h, HEAD_DIM) for h in (HEADS, KV_HEADS, KV_HEADS))
    backend = TorchAttentionBackend()
    backend.plan(metadata)
    whole = backend.forward(0, q, k, v, cache)
    groups = row_groups(new, HEADS, HEAD_DIM, HEADS * heads_per_group)
    assert len(groups) > 1
    starts = metadata.cu_seqlens_q.tolist()
    layout = (metadata.kv_indptr.numpy(), metadata.kv_indices.numpy(), metadata.kv_last_page_len.numpy())
    slices = [group_rows(pieces, starts) for pieces in groups]
    assert [r.start for r in slices] == [0, *(r.stop for r in slices[:-1])] and slices[-1].stop == total
    for pieces, rows in zip(groups, slices):
        qo, indptr, indices, last = group_layout(pieces, new, *layout, PAGE_SIZE)
        kv_lens = [(indptr[i + 1] - indptr[i] - 1) * PAGE_SIZE + last[i] for i in range(len(pieces))]
        num_new = [end - start for _, start, end in pieces]
        tables = [indices[indptr[i]:indptr[i + 1]].tolist() for i in range(len(pieces))]
        group = AttentionMetadata.build(num_new, [kv - n for kv, n in zip(kv_lens, num_new)], tables, PAGE_SIZE,
                                        "cpu")
        assert qo.tolist() == group.cu_seqlens_q.tolist()
        backend.plan(group)  # writes the rows' keys and values again, to the same slots
        torch.testing.assert_close(backend.forward(0, q[rows], k[rows], v[rows], cache), whole[rows])
