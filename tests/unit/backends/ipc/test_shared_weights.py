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
