"""Model families: presets, offline tokenizers, checkpoints of either family, default budgets, shared weights."""
from __future__ import annotations

import builtins
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backends.ipc import shared_weights
from backends.runtime.families import ServedModel
from backends.runtime.families.registry import FAMILIES, build_config, family_for, offline_tokenizer, sampled_ids
from backends.runtime.loader import ModelSpec, load_model
from backends.runtime.presets import PRESETS
from backends.runtime.tokenizer import build_offline_tokenizer, eos_token_ids, special_token_ids
from flashcodec.families import FAMILIES as MEDIA_FAMILIES, Budgets


def test_internvl3_presets_are_the_published_configurations():
    tokenizer = offline_tokenizer("internvl3_8b")
    small, large = build_config("internvl3_8b", tokenizer), build_config("internvl3_38b", tokenizer)
    assert family_for(small) is family_for(large) is FAMILIES["internvl3"]
    for config, text, vision in (
            (small, (3584, 18944, 28, 28, 4), (1024, 24, 16, 4096, "layer_norm", False)),
            (large, (5120, 27648, 64, 40, 8), (3200, 45, 25, 12800, "rms_norm", True))):
        t, v = config.text_config, config.vision_config
        assert (t.hidden_size, t.intermediate_size, t.num_hidden_layers, t.num_attention_heads,
                t.num_key_value_heads) == text
        assert (v.hidden_size, v.num_hidden_layers, v.num_attention_heads, v.intermediate_size, v.norm_type,
                v.use_qk_norm) == vision
        assert t.vocab_size == 151674 and t.model_type == "qwen2" and not config.tie_word_embeddings
        assert config.downsample_ratio == 0.5 and config.dtype == torch.bfloat16
    tiny = build_config("internvl3_tiny", offline_tokenizer("internvl3_tiny")).text_config
    assert tiny.hidden_size // tiny.num_attention_heads == 64
    assert "rope_parameters" in PRESETS["internvl3_tiny"]["text_config"]  # the config did not take the preset's dict
    with pytest.raises(ValueError):
        build_config("nope", tokenizer)


def test_internvl3_offline_tokenizer_has_the_checkpoints_ids_and_template():
    family = FAMILIES["internvl3"]
    full = build_offline_tokenizer(151643, family.special_tokens, family.chat_template)  # Qwen2.5's base vocabulary
    vocab = full.get_vocab()
    assert [vocab[t] for t in ("<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "</box>")] == [
        151645, 151665, 151666, 151667, 151673]  # InternVL3-*-hf's ids; 151674 tokens, InternVL3's vocab_size
    tokenizer = offline_tokenizer("internvl3_tiny")
    assert special_token_ids(tokenizer)["im_end"] == tokenizer.eos_token_id == eos_token_ids(tokenizer)[0]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Hi"}]}],
        tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n<IMG_CONTEXT>\n<video>\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_an_internvl3_checkpoint_loads_as_its_family(tmp_path):
    model, tokenizer = load_model(ModelSpec(preset="internvl3_tiny", seed=3))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, loaded_tokenizer = load_model(ModelSpec(model_path=str(tmp_path), dtype="auto"))
    assert type(loaded) is type(model) and loaded.dtype == torch.float32
    for (name, a), (_, b) in zip(sorted(model.state_dict().items()), sorted(loaded.state_dict().items())):
        assert torch.equal(a, b), name
    assert loaded_tokenizer.get_vocab() == tokenizer.get_vocab()
    assert ServedModel.read("tiny", str(tmp_path)).family.name == "internvl3"  # config.json decides, not the preset
    (tmp_path / "generation_config.json").write_text("[1, 2]")  # transformers' TypeError would name no file
    with pytest.raises(OSError, match="generation_config.json: must hold a JSON object, got list: fix or remove it"):
        ServedModel.read("tiny", str(tmp_path))


def test_the_ids_a_request_may_name_are_those_with_a_token_and_a_logit(tmp_path):
    tokenizer = offline_tokenizer("internvl3_tiny")
    assert sampled_ids(ServedModel.read("internvl3_tiny", None), tokenizer) == len(tokenizer)  # the tokenizer's vocab
    assert sampled_ids(ServedModel.read("internvl3_38b", None), tokenizer) == len(tokenizer)  # 151,674 logit rows
    config = build_config("internvl3_tiny", tokenizer)
    config.text_config.vocab_size = len(tokenizer) - 1  # a checkpoint whose last token has no logit row (<video>)
    config.save_pretrained(tmp_path)
    assert sampled_ids(ServedModel.read("tiny", str(tmp_path)), tokenizer) == len(tokenizer) - 1


def test_default_budgets_per_family(tmp_path):
    assert ServedModel.read("tiny", None).family.budgets == Budgets(encode=10240, prefill=2048)
    assert ServedModel.read("internvl3_38b", None).family.budgets == Budgets(encode=5120, prefill=2048)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava"}))
    with pytest.raises(ValueError, match="llava"):
        ServedModel.read("tiny", str(tmp_path))
    with pytest.raises(OSError):
        ServedModel.read("tiny", str(tmp_path / "missing"))
    with pytest.raises(ValueError):
        Budgets(encode=0, prefill=1)
    # The orchestrator reads the served model and its budgets without torch.
    code = ("import sys; from backends.runtime.families import ServedModel; ServedModel.read('internvl3_tiny', None); "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[4])


def test_each_family_has_both_sides_and_its_own_model_type():
    assert set(FAMILIES) == set(MEDIA_FAMILIES)
    for name, media in MEDIA_FAMILIES.items():
        preset = next(p for p in PRESETS if PRESETS[p]["family"] == name)
        config = build_config(preset, offline_tokenizer(preset))  # the runtime side's transformers config
        assert config.model_type == media.model_type and family_for(config) is FAMILIES[name]


def test_shared_weights_leave_the_internvl3_vision_side_out():
    model, _ = load_model(ModelSpec(preset="internvl3_tiny"))
    names = [name for name, _ in shared_weights.lm_parameters(model)]
    assert names and all(name.startswith(("model.language_model.", "lm_head.")) for name in names)
    assert len(names) + sum(1 for name, _ in model.named_parameters() if name.startswith(
        FAMILIES["internvl3"].vision_prefixes)) == len(list(model.named_parameters()))


def test_the_orchestrator_takes_its_familys_budgets_unless_given():
    from orchestrator.config import OrchestratorConfig

    def budgets(params):
        scheduler = OrchestratorConfig.from_parameters(params).scheduler
        return scheduler.encode_budget, scheduler.prefill_budget

    assert budgets({}) == budgets({"encode_budget": "", "prefill_budget": " "}) == (10240, 2048)
    assert budgets({"preset": "internvl3_38b"}) == (5120, 2048)
    assert budgets({"preset": "internvl3_38b", "encode_budget": "4096"}) == (4096, 2048)


def test_the_orchestrator_reads_the_checkpoints_config_once(tmp_path, monkeypatch):
    from orchestrator.config import OrchestratorConfig
    from orchestrator.service import Orchestrator

    model, tokenizer = load_model(ModelSpec(preset="internvl3_tiny"))
    model.config.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reads, real_open = [], io.open

    def counted(file, *args, **kwargs):
        reads.extend([file] if Path(str(file)).name == "config.json" else [])
        return real_open(file, *args, **kwargs)

    with monkeypatch.context() as patch:  # pathlib opens files with io.open, transformers with open
        patch.setattr(builtins, "open", counted)
        patch.setattr(io, "open", counted)
        config = OrchestratorConfig.from_parameters({"model_path": str(tmp_path)})
        orchestrator = Orchestrator(config, metrics=None)
    assert reads == [tmp_path / "config.json"]  # not again for the tokenizer or the vocabulary size
    assert orchestrator.family.name == "internvl3" and config.scheduler.encode_budget == 5120
    assert orchestrator.sampled_ids == len(tokenizer) and orchestrator.tokenizer.get_vocab() == tokenizer.get_vocab()
