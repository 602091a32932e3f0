"""Dummy weights built by parts (backends/runtime/model_parts.py): any part, built alone, later or in another process,
holds the values the whole model's build gives it."""
from __future__ import annotations

import pytest
import torch

from backends.runtime import model_parts
from backends.runtime.families.registry import family_for
from backends.runtime.loader import ModelSpec, load_model


@pytest.mark.parametrize("preset", ["tiny", "internvl3_tiny"])
def test_parts_built_apart_equal_the_whole(preset):
    whole, _ = load_model(ModelSpec(preset=preset, seed=3))
    vision_only, _ = load_model(ModelSpec(preset=preset, seed=3), ("vision",))
    prefixes = family_for(whole.config).vision_prefixes
    assert {n for n, p in vision_only.named_parameters() if not p.is_meta} == \
        {n for n, _ in whole.named_parameters() if n.startswith(prefixes)}
    model_parts.materialize(vision_only, torch.device("cpu"), 3, ("language_model",))
    for (name, a), (_, b) in zip(whole.state_dict().items(), vision_only.state_dict().items()):
        assert torch.equal(a, b), name


def test_another_seed_other_values_and_the_callers_rng_kept():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    a, _ = load_model(ModelSpec(seed=1))
    assert torch.equal(torch.rand(3), expected)
    b, _ = load_model(ModelSpec(seed=2))
    assert not torch.equal(a.lm_head.weight, b.lm_head.weight)


def test_a_tensor_the_library_leaves_unset_is_named(monkeypatch):
    model, _ = load_model(ModelSpec(), ("vision",))
    cls = type(model)
    original = cls._init_weights

    def skip_lm_head(self, module):
        if module is not model.lm_head:
            original(self, module)

    monkeypatch.setattr(cls, "_init_weights", skip_lm_head)
    with pytest.raises(RuntimeError, match="left 1 tensors unset: lm_head.weight"):
        model_parts.materialize(model, torch.device("cpu"), 0, ("language_model",))


def test_an_unknown_part_is_refused():
    model, _ = load_model(ModelSpec(), ("vision",))
    with pytest.raises(ValueError, match="parts must be among"):
        model_parts.materialize(model, torch.device("cpu"), 0, ("text",))


def test_a_checkpoint_keeps_the_parts_asked_for_and_lets_the_others_go(tmp_path):
    model, tokenizer = load_model(ModelSpec(seed=3))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    prefixes = family_for(model.config).vision_prefixes
    for parts in (("vision",), ("language_model",)):
        loaded, _ = load_model(ModelSpec(model_path=str(tmp_path), dtype="auto"), parts)
        for name, p in loaded.named_parameters():
            kept = ("vision" if name.startswith(prefixes) else "language_model") in parts
            assert p.is_meta != kept, name
            if kept:
                assert torch.equal(p, model.get_parameter(name)), name
        assert not any(b.is_meta for b in loaded.buffers())
