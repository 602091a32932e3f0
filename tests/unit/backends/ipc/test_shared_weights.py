"""One copy of the language-model weights for two stages (backends/ipc/shared_weights.py), in one process on the CPU:
the owner publishes, a second model of the same spec adopts, both compute as before from the same memory."""
from __future__ import annotations

import pytest
import torch

from backends.ipc.run_dir import RUN_DIR_ENV
from backends.ipc import shared_weights
from backends.runtime.loader import ModelSpec, load_model


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    return tmp_path


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_a_second_model_computes_from_the_owners_weights(run_dir):
    cpu = torch.device("cpu")
    owner, _ = load_model(ModelSpec())
    mapper, _ = load_model(ModelSpec())
    ids = torch.tensor([[1, 5, 9, 42, 7]])
    expected = logits(owner, ids)
    shared = shared_weights.publish(owner, "lm_weights", cpu)
    try:
        adopted = shared_weights.adopt(mapper, "lm_weights", cpu)
        assert adopted is not None
        for model, buffer in ((owner, shared.tensor), (mapper, adopted.tensor)):
            start = buffer.data_ptr()
            end = start + buffer.numel() * buffer.element_size()
            for name, p in model.named_parameters():  # the language model in the buffer, the vision tower not
                assert (start <= p.data_ptr() < end) != name.startswith("model.visual."), name
        assert torch.equal(logits(owner, ids), expected) and torch.equal(logits(mapper, ids), expected)
        first = shared_weights.lm_parameters(mapper)[0][1]
        shared.tensor[0] += 1  # one memory: the owner's write is the mapper's weight
        assert first.reshape(-1)[0] == shared.tensor[0]
    finally:
        shared.release()


def test_nothing_published_or_another_model_keeps_its_own_copy(run_dir):
    cpu = torch.device("cpu")
    mapper, _ = load_model(ModelSpec())
    before = [p.data_ptr() for _, p in shared_weights.lm_parameters(mapper)]
    assert shared_weights.adopt(mapper, "lm_weights", cpu) is None  # nothing published
    other, _ = load_model(ModelSpec(dtype="bfloat16"))
    shared = shared_weights.publish(other, "lm_weights", cpu)
    try:
        assert shared_weights.adopt(mapper, "lm_weights", cpu) is None  # float32 model, bfloat16 weights
        assert [p.data_ptr() for _, p in shared_weights.lm_parameters(mapper)] == before
    finally:
        shared.release()


def test_a_mapper_built_without_its_language_model_computes_from_the_owners(run_dir):
    """encode_prefill's start with dummy weights: its language model unbuilt (meta, no memory) until it maps decode's;
    the buffers (rotary tables) are built, the tied and fused parameters rebound."""
    cpu = torch.device("cpu")
    owner, _ = load_model(ModelSpec(preset="internvl3_tiny"))
    mapper, _ = load_model(ModelSpec(preset="internvl3_tiny"), ("vision",))
    assert all(p.is_meta for _, p in shared_weights.lm_parameters(mapper))
    assert not any(b.is_meta for b in mapper.buffers())
    assert shared_weights.held_bytes(mapper, None) == {"own": 0, "shared": 0}
    ids = torch.tensor([[1, 5, 9, 42, 7]])
    expected = logits(owner, ids)
    shared = shared_weights.publish(owner, "lm_weights", cpu)
    try:
        assert shared_weights.adopt(mapper, "lm_weights", cpu) is not None
        assert not any(p.is_meta for p in mapper.parameters())
        assert torch.equal(logits(mapper, ids), expected)
    finally:
        shared.release()


def test_rebind_keeps_tied_parameters_tied():
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2, bias=False, device="meta"),
                                 "b": torch.nn.Linear(2, 2, bias=False, device="meta")})
    model["b"].weight = model["a"].weight
    shared_weights.rebind(model, {"a.weight": torch.ones(2, 2)})
    assert model["a"].weight is model["b"].weight and torch.equal(model["b"].weight, torch.ones(2, 2))
