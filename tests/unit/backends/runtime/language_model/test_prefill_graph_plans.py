"""The step plans of the prefill-graph GPU tests (tests/gpu/test_prefill_graphs.py) run eagerly on the CPU, with torch
attention: every chunk's token ids lie in the model's vocabulary, its positions match its tokens, its block table
holds it, and its helper builds what ``ModelRunner.prefill`` takes.

A plan that does not fit fails here, not on the GPU. There, the first H200 run (2026-12-02) met two: a chunk's
bounds beyond its token ids (``ValueError: chunk positions (3, 64) do not match 32 tokens``), and a 513-token chunk
of ids 3 .. 515 in the tiny presets' 282-token vocabulary, a device-side assert in the embedding gather
(``vectorized_gather_kernel index out of bounds``) that left the CUDA context unusable, so every later test of the
run failed as well."""
import pytest
import torch

from backends.runtime.attention import AttentionMetadata, TorchAttentionBackend
from backends.runtime.language_model.kv_cache import KVCacheLayout, pages_needed
from backends.runtime.loader import ModelSpec, load_model
from backends.runtime.model_runner import ModelRunner
from backends.runtime.presets import PRESETS
from tests.gpu import test_prefill_graphs as plans


def _runner(preset: str, pages: int = 360) -> ModelRunner:
    model, _ = load_model(ModelSpec(preset=preset))
    layout = KVCacheLayout.from_config(model.config, num_pages=pages, page_size=plans.PAGE)
    return ModelRunner(model, torch.zeros(layout.shape), plans.PAGE, TorchAttentionBackend(), compile_vision=False)


@pytest.mark.parametrize("preset", ["tiny", "internvl3_tiny"])
def test_the_chunk_plans_run_on_the_tiny_models(preset):
    runner = _runner(preset)
    vocab = runner.model.lm_head.out_features
    for ids, bounds, table in [*plans.GROWING, plans.STALE_FIRST, plans.STALE_THEN, plans.PADDING]:
        out = plans.prefill(runner, ids, bounds, table)
        assert len(out) == len(bounds) - 1 and all(o.shape == (vocab,) for o in out)
    ids, bounds, table = plans.GROWING[0]
    assert len(plans.prefill(runner, ids, bounds, table, filler=plans.FILLER_PAGES)) == len(bounds) - 1
    two = [plans.chunk(runner, ids, 0, table) for ids, table in plans.TWO_SEQUENCES]
    assert runner.prefill(two).shape == (2, vocab)
    ids, table = plans.LONG_CHUNK
    assert runner.prefill([plans.chunk(runner, ids, 0, table)]).shape == (1, vocab)


def test_the_plans_keep_their_tables_apart():
    """Tables of one runner that the GPU tests compare (KV, logits) do not share pages, and none is the scratch page
    of the 360-page pools (359) or, for the 64-page pool of the padding test, 63."""
    growing = [set(table) for _, _, table in plans.GROWING]
    assert not growing[0] & growing[1] and not (growing[0] | growing[1]) & set(plans.FILLER_PAGES)
    assert max(max(t) for t in growing + [set(plans.FILLER_PAGES)]) < 359
    assert not set(plans.STALE_FIRST[2]) & set(plans.STALE_THEN[2]) and max(plans.STALE_FIRST[2]) < 256
    assert max(plans.PADDING[2]) < 63


def test_a_plan_past_its_ids_is_refused():
    runner = _runner("tiny", pages=16)
    with pytest.raises(ValueError, match="bounds up to 192 for 160 token ids"):
        plans.prefill(runner, plans.token_ids(160, 5), [0, 128, 192], list(range(12)))


def test_an_id_outside_the_vocabulary_fails_on_the_cpu_too():
    """What the 513-token chunk of ids 3 .. 515 did on the GPU (a device-side assert there)."""
    runner = _runner("tiny", pages=40)
    with pytest.raises(IndexError):
        runner.embed(torch.arange(3, 3 + 513))


def test_the_7b_plan_fits_its_vocabulary_and_tables():
    """The 7B test's ids (its preset's vocabulary) and chunk layouts, without building the 7B model."""
    vocab = PRESETS["qwen2_5_vl_7b"]["text_config"]["vocab_size"]
    assert len(plans.TEXT_7B) == 117 and len(plans.CONTEXT_7B) == 14482
    assert 3 <= min(plans.TEXT_7B + plans.CONTEXT_7B) and max(plans.TEXT_7B + plans.CONTEXT_7B) < vocab
    pages = pages_needed(14482, plans.PAGE)
    metadata = AttentionMetadata.build([50], [14432], [list(range(pages))], plans.PAGE, "cpu")
    assert metadata.kv_positions.tolist() == list(range(14432, 14482))
