"""Loader, presets, offline tokenizer and M-RoPE positions."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backends.runtime.loader import ModelSpec, load_model
from backends.runtime.language_model.mrope import mrope_positions
from backends.runtime.families.registry import build_config
from backends.runtime.tokenizer import build_offline_tokenizer, eos_token_ids, special_token_ids

REPO = Path(__file__).resolve().parents[4]

# Prints a hash of the state dict and the tokenizer's ids for a chat prompt, in a fresh interpreter.
_FINGERPRINT = """
import hashlib, json, sys, torch
from backends.runtime.loader import ModelSpec, load_model
model, tokenizer = load_model(ModelSpec(**json.loads(sys.argv[1])))
digest = hashlib.sha256()
for name, tensor in sorted(model.state_dict().items()):
    digest.update(name.encode())
    digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
ids = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "hi"}]}],
                                    add_generation_prompt=True)["input_ids"]
print(json.dumps({"weights": digest.hexdigest(), "ids": ids}))
"""


def _fingerprint(spec: dict) -> dict:
    result = subprocess.run([sys.executable, "-c", _FINGERPRINT, json.dumps(spec)], cwd=REPO, check=True,
                            capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "random"})
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_two_processes_build_identical_weights_and_ids():
    assert _fingerprint({"seed": 7}) == _fingerprint({"seed": 7})


def test_seed_changes_weights():
    a, _ = load_model(ModelSpec(seed=7))
    b, _ = load_model(ModelSpec(seed=8))
    assert not torch.equal(a.lm_head.weight, b.lm_head.weight)


def test_dummy_load_leaves_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    load_model(ModelSpec(seed=5))
    assert torch.equal(torch.rand(3), expected)


def test_load_model_dtype_and_mode():
    model, tokenizer = load_model(ModelSpec(dtype="bfloat16"))
    assert model.dtype == torch.bfloat16 and not model.training
    assert model.config.text_config.vocab_size == len(tokenizer)


def test_checkpoint_round_trip(tmp_path):
    model, tokenizer = load_model(ModelSpec(seed=3))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, loaded_tokenizer = load_model(ModelSpec(model_path=str(tmp_path), dtype="auto"))  # auto: its weights
    assert loaded.dtype == torch.float32
    for (name, a), (_, b) in zip(sorted(model.state_dict().items()), sorted(loaded.state_dict().items())):
        assert torch.equal(a, b), name
    assert special_token_ids(loaded_tokenizer) == special_token_ids(tokenizer)
    random, _ = load_model(ModelSpec(model_path=str(tmp_path), load_format="dummy", seed=4))  # its architecture only
    assert random.lm_head.weight.shape == loaded.lm_head.weight.shape
    assert not torch.equal(random.lm_head.weight, loaded.lm_head.weight)


def test_a_bad_checkpoint_directory_is_named(tmp_path):
    with pytest.raises(OSError, match="is not a directory"):
        load_model(ModelSpec(model_path=str(tmp_path / "missing")))
    model, _ = load_model(ModelSpec())
    model.save_pretrained(tmp_path)  # weights and config, no tokenizer
    with pytest.raises(OSError, match="holds no tokenizer"):
        load_model(ModelSpec(model_path=str(tmp_path)))


def test_spec_from_triton_parameters():
    spec = ModelSpec.from_parameters({"preset": "tiny", "seed": "3", "model_path": "", "page_size": "16"},
                                     device="cpu")
    assert spec == ModelSpec(preset="tiny", seed=3)
    assert ModelSpec.from_parameters({"load_format": "auto"}) == ModelSpec()  # a preset: its seeded random weights
    for bad in ({"load_format": "safetensors"}, {"seed": "x"}, {"dtype": "int8"}, {"preset": "huge"}):
        with pytest.raises(ValueError):
            ModelSpec.from_parameters(bad)


def test_offline_tokenizer_and_chat_template():
    tokenizer = build_offline_tokenizer()
    ids = special_token_ids(tokenizer)
    assert eos_token_ids(tokenizer) == [ids["im_end"], ids["endoftext"]]
    assert tokenizer.eos_token_id == ids["im_end"]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Hi"}]}],
        tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                    "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|video_pad|><|vision_end|>Hi"
                    "<|im_end|>\n<|im_start|>assistant\n")
    encoded = tokenizer(text)["input_ids"]
    assert encoded.count(ids["image_pad"]) == 1 and encoded.count(ids["video_pad"]) == 1
    assert tokenizer.decode(encoded) == text
    assert tokenizer.decode(tokenizer("naïve 视频 test")["input_ids"]) == "naïve 视频 test"


def test_presets():
    tokenizer = build_offline_tokenizer()
    tiny = build_config("tiny", tokenizer)
    assert tiny.video_token_id == special_token_ids(tokenizer)["video_pad"]
    text = tiny.text_config
    assert sum(text.rope_parameters["mrope_section"]) == text.hidden_size // text.num_attention_heads // 2 == 32
    big = build_config("qwen2_5_vl_7b", tokenizer)
    text = big.text_config
    assert (text.hidden_size, text.num_hidden_layers, text.vocab_size) == (3584, 28, 152064)
    assert big.vision_config.fullatt_block_indexes == [7, 15, 23, 31] and big.dtype == torch.bfloat16
    with pytest.raises(ValueError):
        build_config("nope", tokenizer)


def test_mrope_positions():
    tokenizer = build_offline_tokenizer()
    config = build_config("tiny", tokenizer)
    positions, delta = mrope_positions(config, [1, 2, 3, 4])
    assert positions.tolist() == [[0, 1, 2, 3]] * 3 and delta == 0
    image = config.image_token_id
    ids = [1, config.vision_start_token_id] + [image] * 6 + [config.vision_end_token_id, 2]
    positions, delta = mrope_positions(config, ids, image_grid_thw=[(1, 4, 6)])
    # The 2x3 merged grid starts at 2: rows 2..3, columns 2..4; text resumes at 2 + max(2, 3).
    assert positions[:, 2:8].tolist() == [[2] * 6, [2, 2, 2, 3, 3, 3], [2, 3, 4, 2, 3, 4]]
    assert positions[:, 8].tolist() == [5, 5, 5] and delta == 7 - len(ids)
    from_tensor, tensor_delta = mrope_positions(config, torch.tensor(ids), image_grid_thw=[(1, 4, 6)])
    assert torch.equal(from_tensor, positions) and tensor_delta == delta
    with pytest.raises(ValueError, match="pad tokens"):
        mrope_positions(config, ids, image_grid_thw=[(1, 4, 4)])
    with pytest.raises(ValueError, match="second_per_grid_ts"):
        mrope_positions(config, [config.video_token_id] * 6, video_grid_thw=[(1, 4, 6)])
