"""Prompts given as token ids (the orchestrator's ``prompt_token_ids`` input, vLLM's ``TokensPrompt``; the OpenAI
API's completions with ``prompt`` token ids, as lm-evaluation-harness's ``local-completions`` sends them by default)
through a real tritonserver: the same tokens as the prompt sent as text, the first response's ``prompt_text``, and
ids the server cannot take refused by name."""
from __future__ import annotations

import json

import numpy as np
import openai
import pytest
import torch

from backends.runtime.loader import ModelSpec, load_model
from client.api import ServerError
from client.pieces import json_output
from tests.e2e.conftest import openai_sdk
from tests.e2e.test_vllm_parity import kserve_request
from tests.reference import reference_prompt_logprobs

pytestmark = pytest.mark.e2e
GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
MODEL = "tiny"
TEXT = "Once upon a time there was"


@pytest.fixture(scope="module")
def hf():
    return load_model(ModelSpec(device="cuda:0" if torch.cuda.is_available() else "cpu"))


@pytest.fixture(scope="module")
def sdk(server, tmp_path_factory):
    with openai_sdk(server, tmp_path_factory.mktemp("openai")) as client:
        yield client


def request(grpc_url: str, prompt: tuple[str, np.ndarray, str], stream: bool = True, **inputs):
    tensors = [prompt, ("sampling_parameters", np.array([json.dumps(GREEDY).encode()], dtype=np.object_), "BYTES"),
               ("stream", np.array([stream]), "BOOL"), ("return_output_ids", np.array([True]), "BOOL")]
    tensors += [(name, np.array([value]), "BOOL") for name, value in inputs.items()]
    return kserve_request(grpc_url, tensors)


def ids_input(ids: list[int]) -> tuple[str, np.ndarray, str]:
    return "prompt_token_ids", np.array(ids, dtype=np.int64), "INT64"


def output_ids(responses) -> list[int]:
    return [int(i) for r in responses for i in r.as_numpy("output_ids")]


def test_token_ids_give_the_tokens_of_the_same_prompt_as_text_and_its_text_first(grpc_url, hf):
    _, tokenizer = hf
    ids = tokenizer.encode(TEXT)
    as_text = request(grpc_url, ("prompt", np.array([TEXT.encode()], dtype=np.object_), "BYTES"))
    as_ids = request(grpc_url, ids_input(ids))
    assert output_ids(as_ids) == output_ids(as_text) and len(output_ids(as_ids)) == GREEDY["max_tokens"]
    assert json_output(as_ids[0].as_numpy("prompt_text")[0]) == tokenizer.decode(ids)
    assert as_text[0].as_numpy("prompt_text") is None  # a text prompt's is its own
    assert all(r.as_numpy("prompt_text") is None for r in as_ids[1:])
    (whole,) = request(grpc_url, ids_input(ids), stream=False)  # the vLLM backend's whole reply starts with the prompt
    text = b"".join(whole.as_numpy("text_output")).decode()
    assert text.startswith(tokenizer.decode(ids)) and len(text) > len(tokenizer.decode(ids))


@pytest.mark.parametrize("ids,words", [
    ([5, 10**6], "prompt_token_ids: id 1000000 (position 1) is outside the vocabulary"),
    ([-1, 5], "prompt_token_ids: id -1 (position 0) is outside the vocabulary"),
    ("pad", "prompt_token_ids: holds <|image_pad|>, which only the server places"),
    ([], "prompt_token_ids: the prompt is empty"),
])
def test_ids_the_server_cannot_take_are_refused_by_name(grpc_url, hf, ids, words):
    _, tokenizer = hf
    if ids == "pad":
        ids = [5, tokenizer.convert_tokens_to_ids("<|image_pad|>")]
    with pytest.raises(ServerError, match=words.replace("|", r"\|").replace("(", r"\(").replace(")", r"\)")):
        request(grpc_url, ids_input(ids))
    with pytest.raises(ServerError, match="text_input, messages, prompt, prompt_token_ids: send exactly one"):
        kserve_request(grpc_url, [ids_input([5, 6]), ("text_input", np.array([b"hi"], dtype=np.object_), "BYTES")])


def test_lm_evals_tokenized_loglikelihood_request(sdk, hf):
    """lm-evaluation-harness's ``local-completions`` with its default ``tokenized_requests``: a list of token-id
    prompts, ``echo``, ``logprobs`` 1, ``max_tokens`` 1, greedy. Each choice's text is its prompt's text and the
    reply; its log probabilities are the prompt tokens' (the first null) and the reply's, as transformers gives
    them."""
    model, tokenizer = hf
    prompts = [tokenizer.encode("The capital of France"), tokenizer.encode("Two plus two is four")]
    reply = sdk.completions.create(model=MODEL, prompt=prompts, max_tokens=1, temperature=0, echo=True, logprobs=1,
                                   extra_body={"return_token_ids": True})
    assert [c.index for c in reply.choices] == [0, 1]
    for ids, choice in zip(prompts, reply.choices):
        (output,) = choice.token_ids
        assert choice.text == tokenizer.decode(ids) + tokenizer.decode([output])
        reference = reference_prompt_logprobs(model, ids + [output])
        assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in ids + [output]]
        assert choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(
            [float(row[t]) for t, row in zip(ids[1:] + [output], reference)], abs=1e-4)
    assert reply.usage.prompt_tokens == sum(map(len, prompts))
    with pytest.raises(openai.BadRequestError, match=r"- prompt: id 99999999 \(position 1\) is outside") as error:
        sdk.completions.create(model=MODEL, prompt=[5, 99999999], max_tokens=1)
    assert error.value.body["param"] == "prompt"
    for prompt, words in (([[5], [6, 99999999]], r"prompt\[1\]: id 99999999"), ([[5], [6, 2**70]], r"prompt\[1\]: "
                                                                                          r"token id \d+ is not in")):
        with pytest.raises(openai.BadRequestError, match=words):  # a list of prompts, one bad: named, no hang
            sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=1, timeout=60)
