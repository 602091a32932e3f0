"""Paged attention backend and KV layout against a dense causal reference."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from backends.runtime.attention import AttentionMetadata, TorchAttentionBackend
from backends.runtime.context import ForwardContext, forward_context, get_forward_context
from backends.runtime.language_model.kv_cache import KVCacheLayout, pages_needed
from backends.runtime.loader import ModelSpec, load_model

LAYERS, PAGES, PAGE_SIZE, KV_HEADS, HEADS, HEAD_DIM = 2, 64, 4, 2, 6, 8


def _dense_reference(q, k, v, num_cached):
    """float64 causal attention of q [n, H, d] (sequence tokens num_cached..) over k/v [c+n, KVH, d]."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(group, dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * q.shape[-1] ** -0.5
    n, total = q.shape[0], k.shape[0]
    allowed = torch.arange(total)[None, :] <= (num_cached + torch.arange(n))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _run_step(backend, kv_cache, layer, q, k, v, num_new, num_cached, tables):
    metadata = AttentionMetadata.build(num_new, num_cached, tables, PAGE_SIZE, "cpu")
    backend.plan(metadata)
    return backend.forward(layer, q, k, v, kv_cache)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("num_cached,num_new", [
    ([0, 5, 8, 13], [7, 1, 4, 3]),  # ragged chunks on top of cached prefixes, one decode among them
    ([3, 9, 16], [1, 1, 1]),  # decode-only batch
])
def test_paged_attention_matches_dense(dtype, tol, num_cached, num_new):
    torch.manual_seed(0)
    rng = random.Random(0)
    kv_cache = torch.zeros((LAYERS, 2, PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM), dtype=dtype)
    pages = rng.sample(range(PAGES), PAGES)  # shuffled, non-contiguous block tables
    tables, seqs = [], []
    for c, n in zip(num_cached, num_new):
        count = pages_needed(c + n, PAGE_SIZE) + 1  # one spare page, as reserved tables have
        tables.append([pages.pop() for _ in range(count)])
        seqs.append([torch.randn(c + n, heads, HEAD_DIM, dtype=dtype) for heads in (HEADS, KV_HEADS, KV_HEADS)])
    backend = TorchAttentionBackend()
    layer = 1
    # Step 1 fills the cached prefixes (sequences with none skip it), step 2 runs the new tokens.
    first = [i for i, c in enumerate(num_cached) if c > 0]
    _run_step(backend, kv_cache, layer, *(torch.cat([seqs[i][j][:num_cached[i]] for i in first]) for j in range(3)),
              [num_cached[i] for i in first], [0] * len(first), [tables[i] for i in first])
    q, k, v = (torch.cat([s[j][c:] for s, c in zip(seqs, num_cached)]) for j in range(3))
    out = _run_step(backend, kv_cache, layer, q, k, v, num_new, num_cached, tables)

    assert out.shape == q.shape and out.dtype == dtype
    start = 0
    for (sq, sk, sv), c, n in zip(seqs, num_cached, num_new):
        expected = _dense_reference(sq[c:], sk, sv, c)
        torch.testing.assert_close(out[start:start + n].double(), expected, rtol=tol, atol=tol)
        start += n
    # The other layer's pages were never written.
    assert not kv_cache[0].any()


def test_metadata_is_flashinfer_layout():
    metadata = AttentionMetadata.build([3, 1], [5, 8], [[7, 2, 9, 4], [1, 6, 3]], PAGE_SIZE, "cpu")
    assert metadata.cu_seqlens_q.tolist() == [0, 3, 4]
    assert metadata.kv_indptr.tolist() == [0, 2, 5]  # 8 tokens -> 2 pages, 9 tokens -> 3 pages
    assert metadata.kv_indices.tolist() == [7, 2, 1, 6, 3]
    assert metadata.kv_last_page_len.tolist() == [4, 1]
    assert metadata.slot_mapping.tolist() == [2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 3 * 4 + 0]
    assert metadata.batch_indices.tolist() == [0, 0, 0, 1]  # flashinfer's append_paged_kv_cache arguments
    assert metadata.kv_positions.tolist() == [5, 6, 7, 8]
    for name in ("cu_seqlens_q", "num_cached", "kv_indptr", "kv_indices", "kv_last_page_len", "batch_indices",
                 "kv_positions"):
        assert getattr(metadata, name).dtype == torch.int32
    assert metadata.slot_mapping.dtype == torch.int64
    assert not metadata.is_decode
    assert AttentionMetadata.build([1, 1], [5, 0], [[0, 1], [2]], PAGE_SIZE, "cpu").is_decode


def test_metadata_rejects_bad_input():
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMetadata.build([4], [5], [[0, 1]], PAGE_SIZE, "cpu")
    with pytest.raises(ValueError, match="num_new >= 1"):
        AttentionMetadata.build([0], [0], [[0]], PAGE_SIZE, "cpu")
    with pytest.raises(ValueError, match="equal length"):
        AttentionMetadata.build([1, 1], [0], [[0]], PAGE_SIZE, "cpu")


def test_forward_before_plan_raises():
    with pytest.raises(RuntimeError, match="before plan"):
        TorchAttentionBackend().forward(0, torch.zeros(1, 2, 4), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4),
                                        torch.zeros(1, 2, 1, 4, 1, 4))


@pytest.mark.parametrize("table", [[5, 0, 3], np.array([5, 0, 3, 9], dtype=np.int32)], ids=["list", "array"])
def test_slots_and_pages_follow_block_tables(table):
    metadata = AttentionMetadata.build([7, 1], [2, 4], [table, [8, 1]], PAGE_SIZE, "cpu")
    assert metadata.slot_mapping.tolist() == [22, 23, 0, 1, 2, 3, 12, 4]
    assert metadata.kv_indices.tolist() == [5, 0, 3, 8, 1] and metadata.kv_indptr.tolist() == [0, 3, 5]
    assert metadata.kv_last_page_len.tolist() == [1, 1] and metadata.cu_seqlens_q.tolist() == [0, 7, 8]
    assert metadata.kv_indices.dtype == torch.int32 and metadata.slot_mapping.dtype == torch.int64
    with pytest.raises(ValueError, match="cannot hold 5 tokens"):
        AttentionMetadata.build([5], [0], [table[:1]], PAGE_SIZE, "cpu")


def test_layout_from_config():
    model, _ = load_model(ModelSpec())
    layout = KVCacheLayout.from_config(model.config, num_pages=10, page_size=16)
    assert layout.shape == (2, 2, 10, 16, 1, 64)
    assert layout.dtype == torch.float32
    assert layout.page_bytes == 2 * 2 * 16 * 1 * 64 * 4
    with pytest.raises(ValueError):
        KVCacheLayout(2, 0, 16, 2, 16, torch.float32)


def test_forward_context_is_scoped():
    with pytest.raises(RuntimeError, match="outside a forward_context"):
        get_forward_context()
    metadata = AttentionMetadata.build([1], [0], [[0]], PAGE_SIZE, "cpu")
    outer = ForwardContext(TorchAttentionBackend(), torch.zeros(1), metadata)
    inner = ForwardContext(TorchAttentionBackend(), torch.zeros(2), metadata)
    with forward_context(outer):
        with forward_context(inner):
            assert get_forward_context() is inner
        assert get_forward_context() is outer
    with pytest.raises(RuntimeError):
        get_forward_context()
