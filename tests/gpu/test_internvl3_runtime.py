"""InternVL3 at its published sizes on the GPU (dummy weights): the first-step logits of an image+text and a
video+text prompt from our bf16 runner (flashinfer attention, tiles encoded a group at a time, paged prefill)
against transformers' forward on the same weights and inputs (issue 22: relative error 1e-2, argmax equal unless the
reference's top two are closer than that). The reference runs in float32; transformers' own bf16 error against it
is measured for scale (random weights make deep stacks chaotic: ours passes within 1e-2 or within 1.25x the library's
bf16 error). ``internvl3_38b`` does not fit one H200 in float32 (152 GB), so it runs at full width with 16 of its 64
language layers and 12 of its 45 vision layers, every kernel and shape of the full model. At full depth in bf16 on
2026-12-02 ours against transformers' bf16 differed by 8.2% on a text prompt and 12-21% with an image, both
references bf16 (no float32 reference there): hence the float32 reference at reduced depth. Measured on the H200
(2026-12-02), ours / transformers' bf16 against float32: 8B image 0.087 / 0.089, video 0.156 / 0.154; 38B (cut) image
0.114 / 0.115, video 0.232 / 0.231; the 38B video's argmax moved off float32's in transformers' bf16 too.

Run on the device: `python3 -m pytest -q -s tests/gpu/test_internvl3_runtime.py` (skipped without CUDA or
flashinfer).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends.runtime.attention import make_backend
from backends.runtime.families.registry import build_config, offline_tokenizer
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


DEPTHS = {"internvl3_38b": (16, 12)}  # (language, vision) layers kept where float32 would not fit


def spec_of(preset: str, folder: Path) -> ModelSpec:
    """float32 ``preset`` on the GPU, as a dummy-weight checkpoint of its config cut to ``DEPTHS`` where listed."""
    if preset not in DEPTHS:
        return ModelSpec(preset=preset, dtype="float32", device=str(DEVICE))
    tokenizer = offline_tokenizer(preset)
    config = build_config(preset, tokenizer)
    for sub, depth in zip((config.text_config, config.vision_config), DEPTHS[preset]):
        sub.num_hidden_layers = depth
        if getattr(sub, "layer_types", None):  # the language model's per-layer attention kinds
            sub.layer_types = sub.layer_types[:depth]
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return ModelSpec(model_path=str(folder), load_format="dummy", dtype="float32", device=str(DEVICE))


@pytest.mark.parametrize("preset", ["internvl3_8b", "internvl3_38b"])
def test_first_step_logits_match_transformers(preset, tmp_path):
    model, tokenizer = load_model(spec_of(preset, tmp_path))
    torch.manual_seed(0)
    inputs = {}
    for kind, (images, frames) in PROMPTS.items():
        ids = internvl_prompt(tokenizer, images, frames, "What is shown here?")
        inputs[kind] = (ids, torch.randn(sum(images) + frames, 3, 448, 448, device=DEVICE), images, frames)
    reference = {kind: reference_generate(model, ids, 1, tiles=tiles)[1][0] for kind, (ids, tiles, _, _) in
                 inputs.items()}
    model = model.to(torch.bfloat16)
    library_bf16 = {kind: reference_generate(model, ids, 1, tiles=tiles)[1][0] for kind, (ids, tiles, _, _) in
                    inputs.items()}

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
        print(f"{preset} {kind}: ours bf16 vs transformers float32 {err:.4f}, "
              f"transformers bf16 vs float32 {lib_err:.4f}")
        assert err < RTOL or err <= 1.25 * lib_err, (kind, err, lib_err)
        top2 = ref.topk(2)
        if float(top2.values[0] - top2.values[1]) > RTOL * float(ref.abs().max()):
            # where transformers' own bf16 argmax moves off the float32 one, ours may too (bf16 at this depth)
            library_kept = int(library_bf16[kind].argmax()) == int(top2.indices[0])
            assert int(ours.argmax()) == int(top2.indices[0]) or not library_kept, kind
