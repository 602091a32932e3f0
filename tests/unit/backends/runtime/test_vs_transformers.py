"""Our paged runtime (group-wise vision encoding, chunked prefill, paged decode) equals transformers' generate()."""
from __future__ import annotations

import random

import pytest
import torch

from backends.runtime.attention import TorchAttentionBackend
from backends.runtime.language_model.kv_cache import KVCacheLayout
from backends.runtime.loader import ModelSpec, load_model
from backends.runtime.model_runner import DecodeSeq, ModelRunner, PrefillChunk
from backends.runtime.language_model.mrope import mrope_positions
from tests.reference import reference_generate
from tests.unit.backends.runtime.runner_generate import assert_matches_reference, runner_generate

PAGE_SIZE = 4
CHUNK = 13
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def reference():
    model, tokenizer = load_model(ModelSpec())
    return model, tokenizer


@pytest.fixture(scope="module")
def runner():
    # A second model of the same spec (identical weights): the runner takes over its attention.
    model, _ = load_model(ModelSpec())
    layout = KVCacheLayout.from_config(model.config, num_pages=200, page_size=PAGE_SIZE)
    return ModelRunner(model, torch.zeros(layout.shape, dtype=layout.dtype), PAGE_SIZE, TorchAttentionBackend())


def _prompt(tokenizer, config, kind: str, grid: tuple[int, int, int] | None) -> list[int]:
    """Chat-template prompt with its one pad token expanded to t*h*w/4 tokens."""
    content = [{"type": kind}] if kind != "text" else []
    content.append({"type": "text", "text": "Describe what you see, briefly."})
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)["input_ids"]
    if grid is None:
        return ids
    pad = config.image_token_id if kind == "image" else config.video_token_id
    t, h, w = grid
    at = ids.index(pad)
    return ids[:at] + [pad] * (t * h * w // 4) + ids[at + 1:]


def _reference_generate(model, ids, kind, pixels, grid, seconds):
    media = {kind: (pixels, grid, seconds)} if kind != "text" else {}
    return reference_generate(model, ids, NEW_TOKENS, **media)


def _our_generate(runner, ids, kind, pixels, grid, seconds, rng):
    config = runner.model.config
    embeds = runner.embed(torch.tensor(ids))
    if kind != "text":
        t, h, w = grid
        rows = h * w
        # One temporal-patch group at a time, as the encode stage runs them.
        visual = torch.cat([runner.encode(pixels[g * rows:(g + 1) * rows], (1, h, w)) for g in range(t)])
        pad = config.image_token_id if kind == "image" else config.video_token_id
        embeds[torch.tensor(ids, device=embeds.device) == pad] = visual  # in place, as the encode stage does
    positions, delta = mrope_positions(
        config, ids,
        image_grid_thw=[grid] if kind == "image" else [],
        video_grid_thw=[grid] if kind == "video" else [],
        second_per_grid_ts=[seconds] if kind == "video" else [])
    return runner_generate(runner, embeds, positions, delta, NEW_TOKENS, CHUNK, rng)


@pytest.mark.parametrize("kind,grid,seconds", [
    ("video", (4, 8, 12), 1.0),  # 4 temporal-patch groups of 8x12 patches (8 frames), 96 LLM tokens
    ("image", (1, 12, 8), 0.0),
    ("text", None, 0.0),
])
def test_greedy_tokens_match_generate(reference, runner, kind, grid, seconds):
    model, tokenizer = reference
    ids = _prompt(tokenizer, model.config, kind, grid)
    torch.manual_seed(1)
    pixels = torch.randn(grid[0] * grid[1] * grid[2], 1176) if grid else None
    theirs, ref_logits = _reference_generate(model, ids, kind, pixels, grid, seconds)
    ours, our_logits = _our_generate(runner, ids, kind, pixels, grid, seconds, random.Random(0))
    assert len(theirs) == NEW_TOKENS
    assert_matches_reference(ours, theirs, our_logits, ref_logits)


def test_ragged_batches_equal_sequences_run_alone(runner):
    """Two sequences' prefill chunks in one call, then their decode tokens in one call, give each one's
    logits as if it ran alone."""
    torch.manual_seed(2)
    lengths, tables = (9, 5), ([3, 7, 1, 12], [10, 4])
    embeds = [runner.embed(torch.randint(0, 256, (n,))) for n in lengths]
    chunks = [PrefillChunk(e, torch.arange(n).expand(3, -1), 0, t, True) for e, n, t in zip(embeds, lengths, tables)]
    alone = torch.cat([runner.prefill([chunk]) for chunk in chunks])
    torch.testing.assert_close(runner.prefill(chunks), alone, rtol=1e-5, atol=1e-5)
    seqs = [DecodeSeq(42, n, n, t) for n, t in zip(lengths, tables)]
    alone = torch.cat([runner.decode([seq]) for seq in seqs])
    torch.testing.assert_close(runner.decode(seqs), alone, rtol=1e-5, atol=1e-5)


def test_video_encoded_by_group_equals_whole_video(runner):
    torch.manual_seed(3)
    t, h, w = 4, 8, 12
    pixels = torch.randn(t * h * w, 1176)
    whole = runner.encode(pixels, (t, h, w))
    groups = torch.cat([runner.encode(pixels[g * h * w:(g + 1) * h * w], (1, h, w)) for g in range(t)])
    assert whole.shape == (t * h * w // 4, runner.model.config.text_config.hidden_size)
    torch.testing.assert_close(groups, whole, rtol=1e-5, atol=1e-5)


def test_encode_rejects_mismatched_grid(runner):
    with pytest.raises(ValueError, match="grid_thw"):
        runner.encode(torch.zeros(10, 1176), (1, 4, 4))


def test_runner_rejects_a_pool_that_does_not_fit():
    model, _ = load_model(ModelSpec())
    layout = KVCacheLayout.from_config(model.config, num_pages=4, page_size=PAGE_SIZE)
    with pytest.raises(ValueError, match="does not fit"):
        ModelRunner(model, torch.zeros(layout.shape), PAGE_SIZE + 1, TorchAttentionBackend())
    with pytest.raises(ValueError, match="bfloat16"):
        ModelRunner(model, torch.zeros(layout.shape, dtype=torch.bfloat16), PAGE_SIZE, TorchAttentionBackend())
