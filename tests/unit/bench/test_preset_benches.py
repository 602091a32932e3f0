"""bench/runtime_bench.py and bench/vision_bench.py with ``--preset`` (issue 22), what runs without a GPU: the command
lines, the memory floor and FLOPs against hand counts (the 38B built on the meta device: shapes, no memory), a prompt
chunk through a tiny model of either family on the CPU, and InternVL3's tile burst through the family's encoder."""
from __future__ import annotations

import pytest
import torch

from backends.runtime.attention import make_backend
from backends.runtime.families.registry import build_config, family_for, offline_tokenizer
from backends.runtime.language_model.kv_cache import KVCacheLayout
from backends.runtime.loader import ModelSpec, load_model
from backends.runtime.model_runner import ModelRunner
from bench import runtime_bench, vision_bench
from bench.runtime_bench import Sizes, prompt_chunk
from bench.vision_tiles import budget_steps, burst_items, burst_plan, forwards, tile_flops

CPU = torch.device("cpu")


def meta_model(preset: str) -> torch.nn.Module:
    """``preset``'s model in bfloat16 on the meta device (parameters with shapes, no storage)."""
    config = build_config(preset, offline_tokenizer(preset))
    with torch.device("meta"):
        return family_for(config).model_class._from_config(config, dtype=torch.bfloat16)


def test_the_38b_floor_is_the_hand_count_of_its_qwen2_5_32b_language_model():
    sizes = Sizes(meta_model("internvl3_38b"))
    hidden, kv, inter, vocab = 5120, 8 * 128, 27648, 151674
    layer = (hidden * hidden + hidden) + 2 * (hidden * kv + kv) + hidden * hidden + 3 * hidden * inter + 2 * hidden
    body = 64 * layer + hidden  # the layers (q/k/v biases, two RMSNorms each) and the final norm
    assert sizes.body_params == body == 31_206_740_992 and sizes.head_params == vocab * hidden
    assert sizes.read_bytes == 2 * (body + vocab * hidden)  # bf16: every layer, the final norm, the LM head
    assert sizes.kv_token_bytes == 2 * 64 * kv * 2  # K and V, 64 layers, 8 heads of 128, bf16: 256 KiB
    floor = (sizes.read_bytes + hidden * 2 + 4096 * 2 * 64 * kv * 2) / 4.3e12 * 1e3
    assert sizes.decode_floor_ms(1, 4096) == pytest.approx(floor) == pytest.approx(15.126, abs=1e-3)
    attention = 4 * 64 * 40 * 128 * 2048 * 2049 / 2
    assert sizes.prefill_flops(2048) == 2 * body * 2048 + attention + 2 * vocab * hidden
    assert sizes.id_bound == 150000


def test_the_7b_floor_is_still_the_one_in_results():
    sizes = Sizes(meta_model("qwen2_5_vl_7b"))  # bench/RESULTS.md, "decode memory floor"
    floors = [round(sizes.decode_floor_ms(batch, 4096), 2) for batch in (1, 8, 32, 64, 128, 256)]
    assert floors == [3.34, 3.73, 5.04, 6.78, 10.28, 17.27]


@pytest.mark.parametrize("preset", ["tiny", "internvl3_tiny"])
def test_a_prompt_chunk_has_the_familys_positions_and_runs_on_the_cpu(preset):
    model, _ = load_model(ModelSpec(preset=preset))
    sizes = Sizes(model)
    assert sizes.element_bytes == 4 and sizes.id_bound == model.config.get_text_config().vocab_size
    layout = KVCacheLayout.from_config(model.config, num_pages=5, page_size=16, dtype=model.dtype)
    runner = ModelRunner(model, torch.zeros(layout.shape, dtype=layout.dtype), 16,
                         make_backend("torch", model.config, 16, model.dtype, CPU))
    torch.manual_seed(0)
    ids = sizes.random_ids(4000, device=CPU)  # a few hundred ids: every one is drawn
    assert sizes.pad_ids and int(ids.max()) < sizes.id_bound
    assert not any(bool((ids == pad).any()) for pad in sizes.pad_ids)
    ids = ids[:40]
    chunk = prompt_chunk(runner, ids, [0, 1, 2])
    rows = runner.family.position_rows
    assert rows == (3 if preset == "tiny" else 1)  # M-RoPE's three rows, 1-D RoPE's one
    assert torch.equal(chunk.positions, torch.arange(40).expand(rows, -1))
    assert runner.prefill([chunk]).shape == (1, model.config.get_text_config().vocab_size)


def test_runtime_bench_command_line():
    args = runtime_bench.parse_args(["--out", "x"])
    assert (args.preset, args.batches, args.skip_compiled, args.skip_torch_backend) == (
        "qwen2_5_vl_7b", [1, 8, 32, 64, 128, 256], False, False)
    args = runtime_bench.parse_args(["--out", "x", "--preset", "internvl3_38b", "--batches", "1", "8", "32",
                                     "--chunks", "2048", "--skip-baseline", "--skip-compiled", "--skip-torch-backend"])
    assert (args.preset, args.batches, args.chunks) == ("internvl3_38b", [1, 8, 32], [2048])
    assert args.skip_baseline and args.skip_compiled and args.skip_torch_backend
    for bad in (["--preset", "internvl3_99b"], ["--batches", "0"]):
        with pytest.raises(SystemExit):
            runtime_bench.parse_args(["--out", "x", *bad])


def test_vision_bench_command_line_takes_the_familys_cases_and_variants():
    args = vision_bench.parse_args([])
    assert args.cases == list(vision_bench.CASES) and args.variants == list(vision_bench.VARIANTS)
    args = vision_bench.parse_args(["--preset", "internvl3_38b"])
    assert args.cases == ["burst_16x13_tiles", "burst_16x13_tiles_in_steps"]
    assert args.variants == ["transformers_sdpa", "compiled"]
    for bad in (["--preset", "internvl3_38b", "--variants", "varlen"], ["--preset", "internvl3_8b", "--tp-gpus", "2"],
                ["--cases", "burst_16x13_tiles"]):
        with pytest.raises(SystemExit):
            vision_bench.parse_args(bad)


def test_the_38b_tile_flops_are_the_hand_count():
    config = build_config("internvl3_38b", offline_tokenizer("internvl3_38b"))
    n, d, inter, layers, text = 1025, 3200, 12800, 45, 5120  # 1024 patches + CLS; InternViT-6B; Qwen2.5-32B
    per_layer = 2 * n * d * 3 * d + 2 * n * d * d + 2 * n * 2 * d * inter + 4 * n * n * d
    projector = 2 * 256 * (4 * d * text + text * text)  # 256 rows of 4 patches after the pixel shuffle
    tile = 2 * 1024 * 588 * d + layers * per_layer + projector
    assert tile_flops(config, 1)["total"] == tile == 11_991_669_721_600
    assert tile_flops(config, 208)["total"] == 208 * tile


def test_tile_flops_count_every_matmul_of_the_tiny_encoder():
    model, _ = load_model(ModelSpec(preset="internvl3_tiny"))
    vision = model.model.vision_tower
    flops = tile_flops(model.config, 1)
    tokens = vision(torch.zeros(1, 3, 448, 448)).last_hidden_state.shape[1]
    assert tokens == 1025
    linears = [m for m in vision.encoder.modules() if isinstance(m, torch.nn.Linear)]
    assert flops["qkv"] + flops["proj"] + flops["mlp"] == sum(2 * tokens * m.weight.numel() for m in linears)
    projector = [m for m in model.model.multi_modal_projector.modules() if isinstance(m, torch.nn.Linear)]
    assert flops["projector"] == sum(2 * 256 * m.weight.numel() for m in projector)
    assert flops["patch_embed"] == 2 * 1024 * vision.embeddings.patch_embeddings.projection.weight.numel()
    hidden, layers = model.config.vision_config.hidden_size, model.config.vision_config.num_hidden_layers
    assert flops["attention"] == layers * 4 * tokens**2 * hidden


def test_the_burst_is_thirteen_tiles_an_image_in_one_call_or_in_budget_steps():
    plan = burst_plan()
    assert (plan.columns, plan.rows, plan.thumbnail, plan.grid_thw) == (4, 3, True, (13, 32, 32))
    steps = budget_steps([(torch.zeros(13, 1, 1, 1), plan.grid_thw)] * 16, 5120)
    assert len(steps) == 42 and sum(map(len, steps)) == 208 and {len(s) for s in steps[:-1]} == {5}
    assert {grid for step in steps for _, grid in step} == {(1, 32, 32)}
    model, _ = load_model(ModelSpec(preset="internvl3_tiny"))
    family = family_for(model.config)
    encoder = family.vision_encoder(model)
    items = burst_items(plan, CPU, model.dtype, seed=0, images=2)
    one_call, in_steps = forwards(family, encoder)
    with torch.inference_mode():
        whole, stepped = one_call(items), in_steps(budget_steps(items, 5120))
    assert whole.shape == (2 * 13 * 256, model.config.text_config.hidden_size)
    torch.testing.assert_close(stepped, whole)
