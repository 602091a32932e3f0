"""InternVL3 (``internvl3_tiny``, fp32) on our paged runtime equals transformers' InternVLForConditionalGeneration:
first-token logits and greedy tokens of generate() for text, one image (a tile and its thumbnail), several images
and a video given as frames (one tile per frame), with the tiles encoded a group at a time, several in one call."""
from __future__ import annotations

import random

import pytest
import torch

from backends.runtime.attention import TorchAttentionBackend
from backends.runtime.language_model.kv_cache import KVCacheLayout
from backends.runtime.loader import ModelSpec, load_model
from backends.runtime.model_runner import ModelRunner
from flashcodec.families.internvl3 import InternVL3 as InternVL3Media
from flashcodec.families.internvl3_pixels import tile_rows
from flashcodec.patch_pool import read_group, write_group
from tests.reference import internvl_prompt, reference_generate
from tests.unit.backends.runtime.runner_generate import assert_matches_reference, runner_generate

PAGE_SIZE = 16
CHUNK = 97  # chunks that start and end inside images
NEW_TOKENS = 12
SPEC = ModelSpec(preset="internvl3_tiny")
TILE = (1, 32, 32)  # a 448-pixel tile in 14-pixel patches: 256 tokens after the pixel shuffle


@pytest.fixture(scope="module")
def reference():
    return load_model(SPEC)


@pytest.fixture(scope="module")
def runner():
    # A second model of the same spec (identical weights): the runner takes over its attention.
    model, _ = load_model(SPEC)
    layout = KVCacheLayout.from_config(model.config, num_pages=200, page_size=PAGE_SIZE)
    return ModelRunner(model, torch.zeros(layout.shape, dtype=layout.dtype), PAGE_SIZE, TorchAttentionBackend())


def _our_generate(runner, ids, images, frames, tiles):
    """Encode as the stage does (each image whole, each video frame a group of its own, all in one call), place the
    embeddings at the ``<IMG_CONTEXT>`` tokens, then generate."""
    config = runner.model.config
    embeds = runner.embed(torch.tensor(ids))
    grids = [(n, 32, 32) for n in images] + [TILE] * frames
    items, at = [], 0
    for t, h, w in grids:
        items.append((tiles[at:at + t], (t, h, w)))
        at += t
    if items:
        visual = torch.cat(runner.encode_many(items))
        embeds[torch.tensor(ids) == config.image_token_id] = visual
    positions, delta = runner.family.prompt_positions(
        config, ids, image_grid_thw=[(n, 32, 32) for n in images], video_grid_thw=[(frames, 32, 32)] if frames else [],
        second_per_grid_ts=[1.0] if frames else [])
    assert delta == 0 and positions.tolist() == [list(range(len(ids)))]
    return runner_generate(runner, embeds, positions, delta, NEW_TOKENS, CHUNK, random.Random(0))


@pytest.mark.parametrize("images,frames", [
    ([], 0),         # text
    ([2], 0),        # one image: a tile and its thumbnail
    ([3, 1, 2], 0),  # several images
    ([], 4),         # a video of four frames
])
def test_greedy_tokens_match_generate(reference, runner, images, frames):
    model, tokenizer = reference
    ids = internvl_prompt(tokenizer, images, frames)
    count = sum(images) + frames
    torch.manual_seed(1)
    tiles = torch.randn(count, 3, 448, 448) if count else None
    theirs, ref_logits = reference_generate(model, ids, NEW_TOKENS, tiles=tiles)
    ours, our_logits = _our_generate(runner, ids, images, frames, tiles)
    assert len(theirs) == NEW_TOKENS and ids.count(model.config.image_token_id) == 256 * count
    assert_matches_reference(ours, theirs, our_logits, ref_logits)


def test_tiles_encoded_apart_equal_tiles_encoded_together(runner):
    torch.manual_seed(3)
    tiles = torch.randn(3, 3, 448, 448)
    whole = runner.encode(tiles, (3, 32, 32))
    apart = torch.cat([runner.encode(tiles[i:i + 1], TILE) for i in range(3)])
    assert whole.shape == (3 * 256, runner.model.config.text_config.hidden_size)
    torch.testing.assert_close(apart, whole, rtol=1e-5, atol=1e-5)


def test_patch_pool_rows_round_trip_to_tiles(runner):
    """FlashCodec's rows (tile_rows) through a pool of the family's width come back as the very tiles."""
    tiles = torch.randn(2, 3, 448, 448)
    pool = torch.zeros(9, 256, InternVL3Media().patch_dim)  # 588 values a row
    pages = [7, 2, 5, 0, 8, 1, 3, 4]  # 2 tiles x 1024 patches: 8 pages of 256, in any order
    write_group(pool, pages, tile_rows(tiles, 14))
    rows = read_group(pool, pages, 2 * 1024)
    config = runner.model.config
    assert torch.equal(runner.family.pixels_from_patch_rows(config, rows, (2, 32, 32)), tiles)
    with pytest.raises(ValueError, match="grid_thw"):
        runner.family.pixels_from_patch_rows(config, rows[:-1], (2, 32, 32))


def test_encode_and_positions_reject_inputs_that_do_not_fit(runner):
    config = runner.model.config
    with pytest.raises(ValueError, match="grid_thw"):
        runner.encode(torch.zeros(2, 3, 448, 448), TILE)
    with pytest.raises(ValueError, match="grid_thw"):
        runner.encode(torch.zeros(1, 3, 448, 224), (1, 32, 16))  # not square
    with pytest.raises(ValueError, match="pad tokens"):
        runner.family.prompt_positions(config, [config.image_token_id] * 255, image_grid_thw=[TILE])
    with pytest.raises(ValueError, match="second_per_grid_ts"):
        runner.family.prompt_positions(config, [config.image_token_id] * 256, video_grid_thw=[TILE])
    with pytest.raises(ValueError, match="tensor-parallel"):
        ModelRunner(load_model(SPEC)[0], runner.kv_cache, PAGE_SIZE, TorchAttentionBackend(),
                    vision_tp=[torch.device("cpu")])
