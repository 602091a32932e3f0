"""Prompt log probabilities (``sampling_parameters.prompt_logprobs``, vLLM's) through a real tritonserver: each
prompt token's log probability, rank and top tokens equal transformers' log-softmax over the whole prompt, for a
prompt prefilled in several chunks and for one with an image; the prefix cache is not read for them, but written.
Over the OpenAI API: completions' ``echo`` with ``logprobs`` (lm-evaluation-harness's loglikelihood request) and
vLLM's ``prompt_logprobs`` field, whole and streamed."""
from __future__ import annotations

import json
import urllib.request

import openai
import pytest
import torch

from backends.runtime.loader import ModelSpec, load_model
from client.api import Client, ServerError
from tests.e2e.conftest import openai_sdk, settled
from tests.e2e.test_prefix_cache import counters
from tests.media import make_image
from tests.reference import reference_prompt_logprobs, server_request_inputs

pytestmark = pytest.mark.e2e
TOP = 2
PAGE = 16  # decode's kv_page_size (model_repository/decode/config.pbtxt)
GREEDY = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}
MODEL = "tiny"


@pytest.fixture(scope="module")
def hf():
    return load_model(ModelSpec(device="cuda:0" if torch.cuda.is_available() else "cpu"))


@pytest.fixture(scope="module")
def kserve(grpc_url):
    with Client(grpc_url) as client:
        yield client


@pytest.fixture(scope="module")
def sdk(server, tmp_path_factory):
    with openai_sdk(server, tmp_path_factory.mktemp("openai")) as client:
        yield client


def assert_entries_match(entries: list[dict | None], ids: list[int], reference: torch.Tensor, tokenizer,
                         first_is_none: bool = False, top: int = TOP) -> None:
    """Per prompt token after the first: its entry holds its log probability and rank under ``reference`` and the
    ``top`` most likely tokens' (texts, log probabilities); the first token's is None or has null figures."""
    assert len(entries) == len(ids) == reference.shape[0] + 1
    if first_is_none:
        assert entries[0] is None
    else:
        assert entries[0] == {str(ids[0]): {"logprob": None, "rank": None, "decoded_token": tokenizer.decode([ids[0]])}}
    for token, entry, row in zip(ids[1:], entries[1:], reference):
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
        # the tokens at least as likely, itself included (vLLM's rank), up to rounding near the token's own
        assert int((row > row[token] + 1e-4).sum()) + 1 <= own["rank"] <= int((row >= row[token] - 1e-4).sum())
        best_ones = row.topk(top)
        for rank, (best, value) in enumerate(zip(best_ones.indices.tolist(), best_ones.values.tolist()), start=1):
            figures = entry[str(best)]
            assert figures["logprob"] == pytest.approx(value, abs=1e-4)
            assert figures["decoded_token"] == tokenizer.decode([best])
            assert figures["rank"] == rank or best == token


def test_a_chunked_prompts_log_probabilities_equal_transformers_and_skip_reading_the_prefix_cache(kserve, hf):
    """A prompt of over 2,048 tokens (the prefill budget: two chunks, the second's first position after the first's
    last) twice: the same entries both times, no token found in the prefix cache the second time (every position
    computed), while its pages were cached: a later request of the same prompt that does not ask finds them (vLLM
    v1's ``skip_reading_prefix_cache``)."""
    model, tokenizer = hf
    text = " ".join(f"word{i % 97}" for i in range(700))
    ids, _ = server_request_inputs(model, tokenizer, text)
    assert len(ids) > 2048
    reference = reference_prompt_logprobs(model, ids)
    sampling = {**GREEDY, "prompt_logprobs": TOP}
    first = kserve.generate(text, sampling=sampling, stream=True)
    again = kserve.generate(text, sampling=sampling, stream=False)
    assert first.num_input_tokens == len(ids) and first.num_cached_tokens == again.num_cached_tokens == 0
    assert_entries_match(first.prompt_logprobs, ids, reference, tokenizer)
    assert again.prompt_logprobs == first.prompt_logprobs
    plain = kserve.generate(text, sampling=GREEDY)
    assert plain.prompt_logprobs is None and plain.num_cached_tokens == (len(ids) - 1) // PAGE * PAGE


def test_an_image_prompts_log_probabilities_equal_transformers(kserve, hf):
    """Every prompt token, the image's pad tokens included (as vLLM gives them), after the visual embeddings."""
    model, tokenizer = hf
    image = make_image(96, 64)
    ids, media = server_request_inputs(model, tokenizer, "What is this?", image=image)
    result = kserve.generate("What is this?", image=image, sampling={**GREEDY, "prompt_logprobs": TOP})
    assert_entries_match(result.prompt_logprobs, ids, reference_prompt_logprobs(model, ids, **media), tokenizer)


@pytest.mark.parametrize("value", [-1, 21, "many"])
def test_a_prompt_logprobs_count_out_of_range_is_refused_by_name(kserve, value):
    with pytest.raises(ServerError, match="prompt_logprobs"):
        kserve.generate("Hi", sampling={**GREEDY, "prompt_logprobs": value})


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_echoed_completion_starts_its_logprobs_with_the_prompts_as_lm_eval_reads_them(sdk, hf, stream):
    """lm-evaluation-harness's loglikelihood request (``echo``, ``logprobs`` 1, ``max_tokens`` 1, greedy): tokens are
    the prompt's then the reply's, the first prompt token's log probability and top tokens null, the others
    transformers'; the text starts with the prompt."""
    model, tokenizer = hf
    prompt = "The capital of France is Paris"
    reply = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1,
                                   stream=stream, extra_body={"return_token_ids": True})
    choices = [c.choices[0] for c in reply if c.choices] if stream else reply.choices
    text = "".join(c.text for c in choices)
    logprobs = [c.logprobs for c in choices if c.logprobs is not None]
    tokens = [t for lp in logprobs for t in lp.tokens]
    values = [v for lp in logprobs for v in lp.token_logprobs]
    tops = [t for lp in logprobs for t in lp.top_logprobs]
    ids = tokenizer.encode(prompt)
    output = [i for c in choices for i in (c.token_ids or [])]
    reference = reference_prompt_logprobs(model, ids + output)
    assert text.startswith(prompt) and len(output) == 1
    assert tokens == [tokenizer.decode([t]) for t in ids + output]
    assert values[0] is None and tops[0] is None
    assert values[1:] == pytest.approx([float(row[t]) for t, row in zip(ids[1:] + output, reference)], abs=1e-4)
    for token, top, row in zip(ids[1:] + output, tops[1:], reference):
        assert set(top) == {tokenizer.decode([t]) for t in [token, int(row.argmax())]}
    assert logprobs[0].text_offset[:len(ids)] == [sum(len(t) for t in tokens[:k]) for k in range(len(ids))]


def test_echo_with_max_tokens_0_is_the_prompt_alone_with_its_log_probabilities(sdk, hf):
    """vLLM's echo without generation (``max_tokens`` 0), as harnesses that score a prompt send it."""
    model, tokenizer = hf
    prompt = "Scoring this sentence only"
    (choice,) = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=0, temperature=0, echo=True,
                                       logprobs=1).choices
    ids = tokenizer.encode(prompt)
    assert choice.text == prompt and choice.logprobs.tokens == [tokenizer.decode([t]) for t in ids]
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        [float(row[t]) for t, row in zip(ids[1:], reference_prompt_logprobs(model, ids))], abs=1e-4)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):  # without echo 0 stays refused
        sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=0)


def test_n_choices_share_the_first_choices_prompt_log_probabilities_and_its_pages(sdk, hf, server):
    """n=3 with echo and logprobs: the prompt's log probabilities are computed once (the first choice's request;
    the others find its pages in the prefix cache) and every choice's ``logprobs`` and ``prompt_logprobs`` start with
    them."""
    model, tokenizer = hf
    prompt = "A prompt only this test sends, about lighthouses and their keepers"
    before = settled(lambda: counters(server))
    reply = sdk.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=2, temperature=0, echo=True,
                                   logprobs=1)
    after = settled(lambda: counters(server))
    ids = tokenizer.encode(prompt)
    shared = (len(ids) - 1) // PAGE * PAGE
    assert after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"] >= 2 * shared > 0
    first = reply.choices[0]
    assert_entries_match(first.model_extra["prompt_logprobs"], ids, reference_prompt_logprobs(model, ids), tokenizer,
                         first_is_none=True, top=1)
    for choice in reply.choices[1:]:
        assert choice.model_extra["prompt_logprobs"] == first.model_extra["prompt_logprobs"]
        assert choice.logprobs.token_logprobs[:len(ids)] == first.logprobs.token_logprobs[:len(ids)]
        assert choice.text == first.text  # greedy


def test_vllms_prompt_logprobs_field_is_none_first_then_each_tokens_entry(sdk, hf):
    """``prompt_logprobs`` (vLLM's extra field): on a completion's choices and a chat's body, None for the first
    prompt token, then ``{"<id>": {"logprob", "rank", "decoded_token"}}``; refused when streamed, as vLLM does."""
    model, tokenizer = hf
    prompt = "Once upon a time"
    completion = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                        extra_body={"prompt_logprobs": TOP})
    ids = tokenizer.encode(prompt)
    entries = completion.choices[0].model_extra["prompt_logprobs"]
    assert_entries_match(entries, ids, reference_prompt_logprobs(model, ids), tokenizer, first_is_none=True)
    assert completion.choices[0].logprobs is None  # asked for the prompt's alone
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    chat = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 0})
    chat_ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    entries = chat.model_extra["prompt_logprobs"]
    assert len(entries) == len(chat_ids) and entries[0] is None
    reference = reference_prompt_logprobs(model, chat_ids)
    assert [entry[str(t)]["logprob"] for t, entry in zip(chat_ids[1:], entries[1:])] == pytest.approx(
        [float(row[t]) for t, row in zip(chat_ids[1:], reference)], abs=1e-4)
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs: not available when stream is true"):
        sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=2, stream=True,
                               extra_body={"prompt_logprobs": 1})
    streamed = list(sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                                stream=True, extra_body={"prompt_logprobs": 0}))  # 0: taken, as vLLM
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == chat.choices[0].message.content
    assert all("prompt_logprobs" not in (c.model_extra or {}) for c in streamed)  # a stream shows none (vLLM's)


def test_the_http_generate_endpoint_gives_them_as_json(http_url, hf):
    """Triton's HTTP generate: the ``prompt_logprobs`` output is the same JSON text."""
    model, tokenizer = hf
    body = {"text_input": "Hello there", "sampling_parameters": json.dumps({**GREEDY, "prompt_logprobs": 0})}
    request = urllib.request.Request(f"http://{http_url}/v2/models/orchestrator/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    reply = json.loads(urllib.request.urlopen(request, timeout=120).read())
    ids, _ = server_request_inputs(model, tokenizer, "Hello there")
    entries = json.loads(reply["prompt_logprobs"])
    assert [next(iter(entry)) for entry in entries] == [str(t) for t in ids]
