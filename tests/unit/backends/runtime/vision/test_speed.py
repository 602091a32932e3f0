"""Padding the vision MLP leaves the tower's output unchanged; the runner pads always and compiles only on CUDA."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

from backends.runtime.attention import TorchAttentionBackend
from backends.runtime.vision.attention import use_varlen_vision_attention
from backends.runtime.language_model.kv_cache import KVCacheLayout
from backends.runtime.loader import ModelSpec, load_model
from backends.runtime.model_runner import ModelRunner
from backends.runtime.presets import PRESETS
from backends.runtime.vision.speed import compile_vision_blocks, pad_vision_mlp

GRID = [(1, 16, 16), (2, 10, 14)]  # an image and a two-group video: full windows, partial windows


def _tower(intermediate_size: int, dtype: torch.dtype = torch.float32) -> Qwen2_5_VisionTransformerPretrainedModel:
    config = Qwen2_5_VLVisionConfig(**dict(PRESETS["tiny"]["vision_config"], intermediate_size=intermediate_size))
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng():
        torch.manual_seed(0)
        tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(config, dtype=dtype)
    # Nonzero biases everywhere (the library initialises them to zero): a padded row must stay exact anyway.
    with torch.no_grad():
        for block in tower.blocks:
            for linear in (block.mlp.gate_proj, block.mlp.up_proj, block.mlp.down_proj):
                linear.bias.normal_(generator=torch.Generator().manual_seed(linear.out_features))
    return tower.eval()


def _forward(tower, dtype: torch.dtype = torch.float32):
    grid = torch.tensor(GRID)
    pixels = torch.randn(int(grid.prod(-1).sum()), 1176, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        out = tower(pixels, grid_thw=grid)
    return out.last_hidden_state, out.pooler_output


@pytest.mark.parametrize("intermediate_size, multiple, width", [(30, 8, 32), (64, 48, 96), (37, 1, 37)])
def test_padding_leaves_the_output_unchanged(intermediate_size, multiple, width):
    tower = _tower(intermediate_size)
    use_varlen_vision_attention(tower)
    before = _forward(tower)
    assert pad_vision_mlp(tower, multiple) == width
    for block in tower.blocks:
        mlp = block.mlp
        assert (mlp.gate_proj.weight.shape, mlp.up_proj.weight.shape) == ((width, 32), (width, 32))
        assert mlp.down_proj.weight.shape == (32, width) and mlp.intermediate_size == width
        assert (mlp.gate_proj.out_features, mlp.down_proj.in_features) == (width, width)
        assert not mlp.gate_proj.bias[intermediate_size:].any() and not mlp.up_proj.bias[intermediate_size:].any()
        assert not mlp.down_proj.weight[:, intermediate_size:].any()
    assert tower.config.intermediate_size == intermediate_size  # FLOP counts keep the real width
    # Zeros appended to each sum: equal up to the order in which the CPU kernel adds (exactly equal here).
    for after, ref in zip(_forward(tower), before):
        torch.testing.assert_close(after, ref, rtol=1e-6, atol=1e-6)


def test_padding_keeps_dtype_and_is_exact_in_bfloat16():
    tower = _tower(30, torch.bfloat16)
    before = _forward(tower, torch.bfloat16)
    pad_vision_mlp(tower)
    mlp = tower.blocks[0].mlp
    assert {(p.dtype, p.requires_grad) for p in mlp.parameters()} == {(torch.bfloat16, True)}
    for after, ref in zip(_forward(tower, torch.bfloat16), before):
        torch.testing.assert_close(after, ref, rtol=0, atol=0)


def test_padding_an_aligned_width_is_a_no_op():
    tower = _tower(64)
    params = [p for block in tower.blocks for p in block.mlp.parameters()]
    assert pad_vision_mlp(tower) == 64
    assert pad_vision_mlp(tower, 16) == 64
    assert all(a is b for a, b in zip([p for block in tower.blocks for p in block.mlp.parameters()], params))


def test_padding_twice_pads_once():
    tower = _tower(30)
    assert pad_vision_mlp(tower) == 32
    weight = tower.blocks[0].mlp.down_proj.weight
    assert pad_vision_mlp(tower) == 32 and tower.blocks[0].mlp.down_proj.weight is weight


def test_refuses_other_modules_and_bad_multiples():
    tower = _tower(30)
    with pytest.raises(ValueError, match="multiple"):
        pad_vision_mlp(tower, 0)
    with pytest.raises(TypeError, match="vision tower"):
        pad_vision_mlp(tower.blocks[0])
    with pytest.raises(TypeError, match="vision tower"):
        compile_vision_blocks(tower.merger)


def test_compile_wraps_every_block_and_the_merger_lazily():
    tower = _tower(30)
    compile_vision_blocks(tower)  # nothing is traced until a forward, which this CPU test does not run
    assert all(block._compiled_call_impl is not None for block in tower.blocks)
    assert tower.merger._compiled_call_impl is not None


@pytest.mark.parametrize("compile_vision", [True, False])
def test_runner_pads_and_compiles_only_on_cuda(compile_vision):
    model, _ = load_model(ModelSpec())
    visual = model.model.visual
    grid = torch.tensor([GRID[0]])
    pixels = torch.randn(256, 1176, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference = visual(pixels, grid_thw=grid).pooler_output
    layout = KVCacheLayout.from_config(model.config, num_pages=4, page_size=4)
    runner = ModelRunner(model, torch.zeros(layout.shape, dtype=layout.dtype), 4, TorchAttentionBackend(),
                         compile_vision=compile_vision)
    assert all(block._compiled_call_impl is None for block in visual.blocks)  # a CPU model runs uncompiled
    assert visual.blocks[0].mlp.gate_proj.out_features % 8 == 0
    torch.testing.assert_close(runner.encode(pixels, GRID[0]), reference, rtol=1e-5, atol=1e-5)
