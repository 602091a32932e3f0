"""Compiled decoder layers give the same logits as the uncompiled ones (CPU; skipped without a C compiler,
which inductor's CPU backend needs)."""
import shutil

import pytest
import torch

from backends.runtime.attention import TorchAttentionBackend
from backends.runtime.language_model.kv_cache import KVCacheLayout
from backends.runtime.language_model.compile import compile_decoder_layers
from backends.runtime.loader import ModelSpec, load_model
from backends.runtime.model_runner import DecodeSeq, ModelRunner, PrefillChunk


def _steps(compiled: bool) -> list[torch.Tensor]:
    model, _ = load_model(ModelSpec())
    layout = KVCacheLayout.from_config(model.config, num_pages=9, page_size=16)
    runner = ModelRunner(model, torch.zeros(layout.shape), 16, TorchAttentionBackend(), compile_language_model=compiled)
    embeds = runner.embed(torch.arange(3, 40))
    return [runner.prefill([PrefillChunk(embeds, torch.arange(37).expand(3, -1), 0, [0, 1, 2], True)]),
            runner.decode([DecodeSeq(5, 37, 37, [0, 1, 2])]),
            runner.decode([DecodeSeq(5, 37, 37, [0, 1, 2]), DecodeSeq(6, 10, 10, [3])])]


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler for inductor")
def test_compiled_layers_give_the_same_logits():
    for plain, fused in zip(_steps(False), _steps(True)):
        torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)


def test_rejects_a_module_without_layers():
    with pytest.raises(TypeError, match="decoder stack"):
        compile_decoder_layers(torch.nn.Linear(2, 2))
