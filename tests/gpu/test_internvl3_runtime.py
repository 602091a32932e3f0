"""InternVL3 at its published sizes on the GPU (dummy weights): the first-step logits of an image+text and a
video+text prompt from our bf16 runner (flashinfer attention, tiles encoded a group at a time, paged prefill)
against transformers' forward on the same weights and inputs (issue 22: relative error 1e-2, argmax equal unless the
reference's top two are closer than that). ``internvl3_8b``'s reference runs in float32 (the exact reference; the
library's own bf16 error is measured for scale); ``internvl3_38b`` does not fit one H200 in float32, so its reference
is transformers in bf16.

Run on the device: `python3 -m pytest -q -s tests/gpu/test_internvl3_runtime.py` (skipped without CUDA or
flashinfer).
"""
from __future__ import annotations

import pytest
import torch

from backends.runtime.attention import make_backend
from backends.runtime.language_model.kv_cache import KVCacheLayout, pages_needed
from backends.runtime.loader import ModelSpec, load_model
from backends.runtime.model_runner import ModelRunner, PrefillChunk
from tests.gpu.test_flashinfer_runtime import DEVICE, RTOL, rel_err
from tests.reference import internvl_prompt, reference_generate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
PAGE_SIZE = 16
PROMPTS = {"image": ([2], 0), "video": ([], 8)}  # a tile and its thumbnail; eight frames, a tile each


@pytest.fixture(scope="module", autouse=True)
def _flashinfer():
    pytest.importorskip("flashinfer")


@pytest.mark.parametrize("preset,reference_dtype", [("internvl3_8b", "float32"), ("internvl3_38b", "bfloat16")])
def test_first_step_logits_match_transformers(preset, reference_dtype):
    model, tokenizer = load_model(ModelSpec(preset=preset, dtype=reference_dtype, device=str(DEVICE)))
    torch.manual_seed(0)
    inputs = {}
    for kind, (images, frames) in PROMPTS.items():
        ids = internvl_prompt(tokenizer, images, frames, "What is shown here?")
        inputs[kind] = (ids, torch.randn(sum(images) + frames, 3, 448, 448, device=DEVICE), images, frames)
    reference = {kind: reference_generate(model, ids, 1, tiles=tiles)[1][0] for kind, (ids, tiles, _, _) in
                 inputs.items()}
    model = model.to(torch.bfloat16)
    library_bf16 = ({kind: reference_generate(model, ids, 1, tiles=tiles)[1][0]
                     for kind, (ids, tiles, _, _) in inputs.items()} if reference_dtype == "float32" else reference)

    config = model.config
    layout = KVCacheLayout.from_config(config, num_pages=256, page_size=PAGE_SIZE, dtype=torch.bfloat16)
    runner = ModelRunner(model, torch.zeros(layout.shape, dtype=layout.dtype, device=DEVICE), PAGE_SIZE,
                         make_backend("flashinfer", config, PAGE_SIZE, model.dtype, DEVICE))
    for kind, (ids, tiles, images, frames) in inputs.items():
        embeds = runner.embed(torch.tensor(ids, device=DEVICE))
        groups = [runner.encode(tiles[i:i + 1], (1, 32, 32)) for i in range(tiles.shape[0])]  # a tile a group
        embeds[torch.tensor(ids, device=DEVICE) == config.image_token_id] = torch.cat(groups)
        positions, _ = runner.family.prompt_positions(
            config, ids, image_grid_thw=[(n, 32, 32) for n in images],
            video_grid_thw=[(frames, 32, 32)] if frames else [], second_per_grid_ts=[1.0] if frames else [])
        ours = runner.prefill([PrefillChunk(embeds, positions.to(DEVICE), 0,
                                            list(range(pages_needed(len(ids), PAGE_SIZE))), want_logits=True)])[0]
        ref = reference[kind].float()
        err, lib_err = rel_err(ours, ref), rel_err(library_bf16[kind], ref)
        print(f"{preset} {kind}: ours bf16 vs transformers {reference_dtype} {err:.4f}, "
              f"transformers bf16 vs {reference_dtype} {lib_err:.4f}")
        assert err < RTOL or err <= 1.25 * lib_err, (kind, err, lib_err)
        top2 = ref.topk(2)
        if float(top2.values[0] - top2.values[1]) > RTOL * float(ref.abs().max()):
            assert int(ours.argmax()) == int(top2.indices[0]), kind
