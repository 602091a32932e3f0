"""A checkpoint directory (`model_path` alone, as the README says) is served with its own weights and tokenizer."""
from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from backends.triton.repository import parse_overrides
from backends.runtime.loader import ModelSpec, load_model
from client.api import Client
from tests.e2e.conftest import repository_with, serve
from tests.media import make_image
from tests.reference import assert_same_or_tie, server_request_reference

pytestmark = pytest.mark.e2e
N = 8


def test_a_checkpoint_directory_is_served_with_its_weights(tmp_path, media_dir):
    checkpoint = tmp_path / "checkpoint"
    model, tokenizer = load_model(ModelSpec(seed=7))  # not the preset's seed-0 weights the server has by default
    model.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    del model
    repository = repository_with(tmp_path / "repository", parse_overrides([f"*.model_path={checkpoint}"]))
    image, question = make_image(120, 90, "RGB", "PNG"), "What is in the picture?"
    # top_k 1 from its generation_config.json makes a request that sends no sampling values greedy (vLLM's rule:
    # orchestrator.generation_defaults); the built-in temperature 1.0 would sample the random model's flat output
    # and its max_new_tokens caps a reply whose max_tokens is null (an OpenAI chat request without it)
    GenerationConfig(do_sample=True, top_k=1, temperature=0.7, max_new_tokens=5).save_pretrained(checkpoint)
    with serve(media_dir, repository) as srv, Client(f"127.0.0.1:{srv.ports.grpc}") as client:
        result = client.generate(question, image=image, return_output_ids=True,
                                 sampling={"max_tokens": N, "temperature": 0, "ignore_eos": True})
        by_default = client.generate(question, image=image, return_output_ids=True,
                                     sampling={"max_tokens": N, "ignore_eos": True})
        capped = client.generate(question, sampling={"max_tokens": None, "ignore_eos": True})
        assert (capped.num_output_tokens, capped.finish_reason) == (5, "length")
        assert "defaults from the checkpoint's generation_config.json: sampling {'temperature': 0.7, 'top_k': 1}, " \
               "max_new_tokens 5" in srv.log_tail(200_000)
    device = "cuda:0" if torch.cuda.is_available() else "cpu"  # the stages take the GPU when there is one
    reference = load_model(ModelSpec(model_path=str(checkpoint), device=device))
    expected = server_request_reference(*reference, question, N, image=image)
    assert_same_or_tie(result.token_ids, *expected)
    assert_same_or_tie(by_default.token_ids, *expected)
