"""The varlen vision attention equals per-segment SDPA, and the vision tower with it equals transformers' sdpa path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from backends.runtime.attention import TorchAttentionBackend
from backends.runtime.vision.attention import (VARLEN_VISION_ATTENTION, use_varlen_vision_attention,
                                               varlen_vision_attention)
from backends.runtime.language_model.kv_cache import KVCacheLayout
from backends.runtime.loader import ModelSpec, load_model
from backends.runtime.model_runner import PAGED_ATTENTION, ModelRunner


def _qkv(tokens: int, heads: int = 3, head_dim: int = 10, seed: int = 0):
    """q/k/v ``[1, heads, T, d]`` laid out as transformers' vision attention hands them over (v a strided view)."""
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, 3, heads, head_dim, generator=generator)
    q, k, v = qkv.permute(1, 0, 2, 3).unbind(0)
    return [t.transpose(0, 1).unsqueeze(0) for t in (q.contiguous(), k.contiguous(), v)]


def _reference(q, k, v, bounds: list[int], scale: float | None = None) -> torch.Tensor:
    """One SDPA per segment, concatenated: ``[1, T, heads, d]``."""
    outs = [F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], scale=scale)
            for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    return torch.cat(outs, dim=2).transpose(1, 2)


@pytest.mark.parametrize("bounds", [
    [0, 16, 32, 48, 64],                      # one length
    [0, 16, 28, 44, 44, 50, 66, 78, 79],      # several lengths, interleaved, a zero-length segment, a 1-token one
    [0, 37],                                   # one segment
])
def test_function_equals_per_segment_sdpa(bounds):
    q, k, v = _qkv(bounds[-1])
    cu = torch.tensor(bounds, dtype=torch.int32)
    out, weights = varlen_vision_attention(None, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                           max_length_q=99, max_length_k=99, is_causal=False)
    assert weights is None and out.shape == (1, bounds[-1], 3, 10)
    torch.testing.assert_close(out, _reference(q, k, v, bounds, scale=0.3), rtol=1e-5, atol=1e-5)


def test_without_boundaries_is_one_segment():
    q, k, v = _qkv(20)
    out, _ = varlen_vision_attention(None, q, k, v, None)
    torch.testing.assert_close(out, _reference(q, k, v, [0, 20]), rtol=1e-5, atol=1e-5)


def test_boundaries_changed_in_place_are_replanned():
    q, k, v = _qkv(30)
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    varlen_vision_attention(None, q, k, v, None, cu_seq_lens_q=cu)
    cu[1] = 20
    out, _ = varlen_vision_attention(None, q, k, v, None, cu_seq_lens_q=cu)
    torch.testing.assert_close(out, _reference(q, k, v, [0, 20, 30]), rtol=1e-5, atol=1e-5)


def test_rejects_what_it_does_not_compute():
    q, k, v = _qkv(8)
    cu = torch.tensor([0, 4, 8])
    with pytest.raises(ValueError, match="non-causal"):
        varlen_vision_attention(None, q, k, v, None, cu_seq_lens_q=cu, is_causal=True)
    with pytest.raises(ValueError, match="non-causal"):
        varlen_vision_attention(None, q, k, v, torch.zeros(1, 1, 8, 8), cu_seq_lens_q=cu)
    with pytest.raises(ValueError, match="token count"):
        varlen_vision_attention(None, q, k, v, None, cu_seq_lens_q=torch.tensor([0, 4, 7]))
    with pytest.raises(ValueError, match="cu_seq_lens_k"):
        varlen_vision_attention(None, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=torch.tensor([0, 2, 8]))
    with pytest.raises(ValueError, match="one shape"):
        varlen_vision_attention(None, q, k[:, :2], v, None, cu_seq_lens_q=cu)


@pytest.fixture(scope="module")
def model():
    model, _ = load_model(ModelSpec())
    return model


# Tiny tower: 14-pixel patches, 2x2 merge, 112-pixel windows = 8x8 patches (64 rows); block 1 attends per frame.
@pytest.mark.parametrize("grid_thw", [
    [(1, 16, 16)],                          # image: four full windows
    [(3, 12, 20)],                          # video of 3 temporal-patch groups, windows of 64, 32 and 16 rows
    [(1, 10, 14)],                          # windows of 64, 48, 16 and 12 rows
    [(1, 16, 16), (1, 10, 14), (2, 8, 12)],  # several images and a video in one call: frames of unequal length
])
def test_tower_equals_transformers_sdpa(model, grid_thw):
    visual = model.model.visual
    grid = torch.tensor(grid_thw)
    pixels = torch.randn(int(grid.prod(-1).sum()), 1176, generator=torch.Generator().manual_seed(4))
    calls = []

    def counting(*args, **kwargs):
        calls.append(kwargs["cu_seq_lens_q"])
        return varlen_vision_attention(*args, **kwargs)

    # A name with "flash" in it, like ours: transformers then calls the function once per layer.
    AttentionInterface.register("test_flash_counting", counting)
    try:
        with torch.no_grad():
            visual.config._attn_implementation = "sdpa"
            theirs = visual(pixels, grid_thw=grid)
            visual.config._attn_implementation = "test_flash_counting"
            counted = visual(pixels, grid_thw=grid)
            use_varlen_vision_attention(visual)
            ours = visual(pixels, grid_thw=grid)
    finally:
        visual.config._attn_implementation = "sdpa"
    assert len(calls) == visual.config.depth
    for name in ("last_hidden_state", "pooler_output"):
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(counted[name], ours[name], rtol=0, atol=0)


def test_runner_switches_the_tower_and_keeps_paged_attention_for_the_language_model():
    model, _ = load_model(ModelSpec())
    layout = KVCacheLayout.from_config(model.config, num_pages=4, page_size=4)
    ModelRunner(model, torch.zeros(layout.shape, dtype=layout.dtype), 4, TorchAttentionBackend())
    assert model.model.visual.config._attn_implementation == VARLEN_VISION_ATTENTION
    assert all(block.attn.config._attn_implementation == VARLEN_VISION_ATTENTION for block in model.model.visual.blocks)
    assert model.model.language_model.config._attn_implementation == PAGED_ATTENTION
    assert model.config.text_config._attn_implementation == PAGED_ATTENTION


def test_switch_refuses_other_modules(model):
    with pytest.raises(TypeError, match="vision tower"):
        use_varlen_vision_attention(model.model.language_model)
