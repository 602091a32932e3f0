"""The vLLM backend's I/O through a real tritonserver, as its clients send it (tritonclient, no client of ours):
the ``return_*`` flags and their outputs (log probabilities held to transformers' logits), base64 text in ``image``,
and the sampling keys ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty`` and ``stop_token_ids``, held
to transformers' ``generate()``, and ``logit_bias``."""
from __future__ import annotations

import base64
import json
import queue
import urllib.request

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from backends.runtime.loader import ModelSpec, load_model
from backends.runtime.tokenizer import load_tokenizer
from client.api import Client, ServerError, grpc_inputs, request_tensors
from orchestrator.sampling_params import RequestParams
from tests.media import make_image
from tests.reference import assert_same_or_tie, reference_prompt, server_request_reference

pytestmark = pytest.mark.e2e
N = 12
GREEDY = {"max_tokens": N, "temperature": 0, "ignore_eos": True}
PROMPT = "Say the same thing again and again."


@pytest.fixture(scope="module")
def hf():
    """The tiny dummy model the server runs, in this process (as tests/e2e/test_generation.py loads it)."""
    return load_model(ModelSpec(device="cuda:0" if torch.cuda.is_available() else "cpu"))


def vllm_request(grpc_url: str, text: str, sampling: dict, stream: bool = True, timeout_s: float = 120,
                 **flags) -> list[grpcclient.InferResult]:
    """One request as a vLLM-backend client sends it, ``flags`` (``return_finish_reason=True``, ...) as BOOL [1]
    inputs; returns its responses in order. Raises ServerError with the server's message."""
    tensors = request_tensors(text, sampling=sampling, stream=stream, exclude_input_in_output=True)
    tensors += [(name, np.array([value], dtype=bool), "BOOL") for name, value in flags.items()]
    return kserve_request(grpc_url, tensors, timeout_s)


def kserve_request(grpc_url: str, tensors: list[tuple[str, np.ndarray, str]], timeout_s: float = 120,
                   parameters: dict | None = None) -> list[grpcclient.InferResult]:
    """One request of these input ``tensors`` (``(name, array, Triton type)``) and request ``parameters`` over gRPC's
    stream; returns its responses with outputs, in order. Raises ServerError with the server's message."""
    responses: queue.Queue = queue.Queue()
    results = []
    with grpcclient.InferenceServerClient(grpc_url) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        try:
            client.async_stream_infer("orchestrator", grpc_inputs(tensors), enable_empty_final_response=True,
                                      parameters=parameters)
            while True:
                result, error = responses.get(timeout=timeout_s)
                if error is not None:
                    raise ServerError(str(error))
                results.append(result)
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return [r for r in results if r.as_numpy("text_output") is not None]
        finally:
            client.stop_stream()


def http_generate(http_url: str, body: dict) -> dict:
    """Triton's HTTP ``generate`` of the orchestrator with JSON ``body``: its one JSON answer."""
    request = urllib.request.Request(f"http://{http_url}/v2/models/orchestrator/generate", method="POST",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=120).read())


def test_return_flags_put_their_outputs_on_every_response_as_the_vllm_backend_does(grpc_url):
    """Each response carries the outputs asked for: ``finish_reason`` ("None" until the last, vLLM's
    ``str(finish_reason)``), ``num_input_tokens`` and ``num_output_tokens`` (that response's tokens: one per
    response, or more when the server fell behind its client), both UINT32 as in the vLLM backend's config."""
    responses = vllm_request(grpc_url, PROMPT, GREEDY, return_finish_reason=True, return_num_input_tokens=True,
                             return_num_output_tokens=True, return_output_ids=True)
    reasons = [r.as_numpy("finish_reason")[0].decode() for r in responses]
    assert reasons == ["None"] * (len(responses) - 1) + ["length"]
    counts = [r.as_numpy("num_output_tokens") for r in responses]
    assert all(c.dtype == np.uint32 for c in counts) and sum(int(c[0]) for c in counts) == N
    assert [int(c[0]) for c in counts] == [len(r.as_numpy("output_ids")) for r in responses]
    inputs = {int(r.as_numpy("num_input_tokens")[0]) for r in responses}
    assert len(inputs) == 1 and inputs.pop() > 5 and responses[0].as_numpy("num_input_tokens").dtype == np.uint32
    (whole,) = vllm_request(grpc_url, PROMPT, GREEDY, stream=False, return_num_output_tokens=True,
                            return_finish_reason=True)
    assert int(whole.as_numpy("num_output_tokens")[0]) == N and whole.as_numpy("finish_reason")[0] == b"length"


def test_without_flags_the_last_response_still_carries_the_totals(grpc_url):
    responses = vllm_request(grpc_url, PROMPT, GREEDY)
    assert all(r.as_numpy("finish_reason") is None for r in responses[:-1])
    assert int(responses[-1].as_numpy("num_output_tokens")[0]) == N
    assert responses[-1].as_numpy("finish_reason")[0] == b"length"


@pytest.mark.parametrize("stream", [True, False])
def test_log_probabilities_equal_the_log_softmax_of_transformers_logits(grpc_url, hf, stream):
    """``return_logprobs`` with ``logprobs`` 3 in ``sampling_parameters``: per token of each response, the vLLM
    backend's ``{"<id>": {"logprob", "rank", "decoded_token"}}``, the sampled token first, then the 3 most likely;
    the figures are the log-softmax of transformers' logits over the prompt and the output, before the repetition
    penalty that chose the tokens (vLLM's raw log probabilities), prefill's first token and decode's alike;
    ``cumulative_logprob`` (FP32) their running sum."""
    model, tokenizer = hf
    sampling = {**GREEDY, "logprobs": 3, "repetition_penalty": 0.7}  # below 1: the reply repeats itself
    responses = vllm_request(grpc_url, PROMPT, sampling, stream=stream, return_logprobs=True,
                             return_cumulative_logprob=True, return_output_ids=True)
    ids = [int(t) for r in responses for t in r.as_numpy("output_ids")]
    entries = [e for r in responses for e in json.loads(r.as_numpy("logprobs")[0])]
    assert len(ids) == len(entries) == N
    prompt = reference_prompt(model, tokenizer, PROMPT)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids], device=model.device)).logits[0, len(prompt) - 1:-1]
    reference = torch.log_softmax(logits.float(), dim=-1).cpu()
    assert any(reference[step].argmax() != token for step, token in enumerate(ids))  # the penalty chose some
    for step, (token, entry) in enumerate(zip(ids, entries)):
        assert list(entry)[0] == str(token)
        assert entry[str(token)]["logprob"] == pytest.approx(float(reference[step, token]), abs=1e-4)
        assert entry[str(token)]["decoded_token"] == tokenizer.decode([token])
        top = reference[step].topk(3)
        assert {str(t) for t in top.indices.tolist()} <= set(entry)
        assert [entry[str(t)]["logprob"] for t in top.indices.tolist()] == pytest.approx(top.values.tolist(),
                                                                                          abs=1e-4)
    sums = [float(r.as_numpy("cumulative_logprob")[0]) for r in responses]
    assert responses[-1].as_numpy("cumulative_logprob").dtype == np.float32
    assert sums[-1] == pytest.approx(float(reference[torch.arange(N), ids].sum()), abs=1e-3)


def test_the_python_clients_return_logprobs_gathers_an_entry_per_token_and_their_sum(grpc_url):
    with Client(grpc_url) as client:
        result = client.generate(PROMPT, sampling={**GREEDY, "logprobs": 1}, return_logprobs=True,
                                 return_output_ids=True)
    assert [next(iter(entry)) for entry in result.logprobs] == [str(t) for t in result.token_ids]
    assert all(len(entry) <= 2 for entry in result.logprobs) and len(result.token_ids) == N
    total = sum(next(iter(entry.values()))["logprob"] for entry in result.logprobs)
    assert result.cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_without_the_flags_no_log_probabilities_are_sent(grpc_url):
    last = vllm_request(grpc_url, PROMPT, {**GREEDY, "logprobs": 2}, return_logprobs=False)[-1]
    assert last.as_numpy("logprobs") is None and last.as_numpy("cumulative_logprob") is None
    assert last.as_numpy("finish_reason")[0] == b"length"


def test_base64_text_in_image_equals_the_files_bytes(grpc_url):
    image = make_image(96, 64, "RGB", "PNG")
    with Client(grpc_url) as client:
        as_bytes = client.generate("Describe.", image=image, sampling=GREEDY, return_output_ids=True)
        as_text = client.generate("Describe.", image=base64.b64encode(image), sampling=GREEDY,
                                  return_output_ids=True)
    assert as_text.token_ids == as_bytes.token_ids and as_text.num_input_tokens == as_bytes.num_input_tokens > 50


def test_an_http_json_body_carries_a_base64_image_and_the_flags(http_url, grpc_url):
    """Over HTTP ``generate`` the vLLM backend's JSON: ``image`` as base64 text, a ``return_*`` flag, the
    penalties in ``sampling_parameters`` (a JSON string); the tokens are the gRPC request's."""
    image = make_image(96, 64, "RGB", "PNG")
    sampling = {**GREEDY, "repetition_penalty": 1.3}
    body = {"text_input": "Describe.", "image": [base64.b64encode(image).decode()], "stream": False,
            "exclude_input_in_output": True, "return_finish_reason": True, "return_num_output_tokens": True,
            "return_output_ids": True, "sampling_parameters": json.dumps(sampling)}
    answer = http_generate(http_url, body)
    with Client(grpc_url) as client:
        expected_ids = client.generate("Describe.", image=image, sampling=sampling, return_output_ids=True).token_ids
    assert answer["finish_reason"] == "length" and answer["num_output_tokens"] == N
    assert answer["output_ids"] == expected_ids


def test_request_parameters_are_the_sampling_parameters_where_that_input_is_absent(http_url, grpc_url):
    """As the vLLM backend reads them (its ``utils/request.py``): a generate body's ``parameters`` object (its
    ``stream`` key left to the input) and its top-level fields that are no inputs, tritonclient's ``parameters=``;
    a generate body's ``id`` is the request id, not a sampling key, nor are ``priority`` and ``timeout``; the
    ``sampling_parameters`` input wins where both come; an unknown key is refused naming ``parameters``."""
    body = {"id": "r-1", "text_input": PROMPT, "exclude_input_in_output": True, "return_output_ids": True,
            "parameters": {**GREEDY, "max_tokens": 5, "stream": False, "priority": 1, "timeout": 10**9}}
    answer = http_generate(http_url, body)
    with Client(grpc_url) as client:
        expected = client.generate(PROMPT, sampling={**GREEDY, "max_tokens": 5}, return_output_ids=True).token_ids
    assert answer["output_ids"] == expected and len(expected) == 5 and answer["id"] == "r-1"
    top_level = {"id": "r-2", "text_input": PROMPT, "exclude_input_in_output": True, "return_output_ids": True,
                 **GREEDY, "max_tokens": 3}
    assert http_generate(http_url, top_level)["output_ids"] == expected[:3]
    text = [("text_input", np.array([PROMPT.encode()], dtype=np.object_), "BYTES"),
            ("return_num_output_tokens", np.array([True]), "BOOL")]
    counted = kserve_request(grpc_url, text, parameters={**GREEDY, "max_tokens": 3, "temperature": 0.0, "top_p": 0.5})
    assert sum(int(r.as_numpy("num_output_tokens")[0]) for r in counted) == 3
    both = text + [("sampling_parameters", np.array([json.dumps({**GREEDY, "max_tokens": 4}).encode()],
                                                    dtype=np.object_), "BYTES")]
    assert sum(int(r.as_numpy("num_output_tokens")[0]) for r in kserve_request(grpc_url, both,
                                                                                parameters={"max_tokens": 2})) == 4
    with pytest.raises(ServerError, match="parameters: unknown key 'foo' \\(known: "):
        kserve_request(grpc_url, text, parameters={"max_tokens": 3, "foo": 1})
    with pytest.raises(ServerError, match="parameters: unknown key 'video_urls': not an input of this model"):
        kserve_request(grpc_url, both, parameters={"video_urls": "clip.mp4"})  # beside sampling_parameters too


@pytest.mark.parametrize("penalties", [  # the dummy model's greedy reply repeats no token: a penalty above 1 leaves it
    {"repetition_penalty": 0.8},
    {"repetition_penalty": 0.7, "presence_penalty": 1.0},
    {"presence_penalty": -1.5, "frequency_penalty": -0.75},  # negative: the output repeats itself
])
def test_penalties_equal_transformers_generate_and_change_the_output(grpc_url, hf, penalties):
    """Greedy tokens with the penalties equal transformers' generate() with its repetition processor and vLLM's
    presence/frequency formula (tests/reference.py), and differ from the tokens without them."""
    with Client(grpc_url) as client:
        plain = client.generate(PROMPT, sampling=GREEDY, return_output_ids=True).token_ids
        result = client.generate(PROMPT, sampling={**GREEDY, **penalties}, return_output_ids=True)
    assert result.finish_reason == "length" and result.token_ids != plain
    assert_same_or_tie(result.token_ids, *server_request_reference(*hf, PROMPT, N,
                                                                   params=RequestParams(**penalties)))


def test_logit_bias_forces_or_bans_tokens_in_prefill_and_decode(grpc_url):
    """``logit_bias`` (OpenAI's and vLLM's): +100 on a token makes every greedy token that one, the first (prefill's)
    and the rest (decode's); -100 on the plain reply's first token takes it away."""
    with Client(grpc_url) as client:
        plain = client.generate(PROMPT, sampling=GREEDY, return_output_ids=True).token_ids
        forced = client.generate(PROMPT, sampling={**GREEDY, "logit_bias": {str(plain[3]): 100}},
                                 return_output_ids=True).token_ids
        banned = client.generate(PROMPT, sampling={**GREEDY, "logit_bias": {str(plain[0]): -100}},
                                 return_output_ids=True).token_ids
    assert forced == [plain[3]] * N and banned[0] != plain[0] and plain[0] not in banned


def test_stop_token_ids_end_the_output_with_reason_stop_after_min_tokens(grpc_url):
    with Client(grpc_url) as client:
        plain = client.generate(PROMPT, sampling=GREEDY, return_output_ids=True).token_ids
        k = next((i for i in range(2, N - 1) if plain[i] not in plain[:i]), None)  # a token first made at step k
        assert k is not None, plain
        stopped = client.generate(PROMPT, sampling={**GREEDY, "stop_token_ids": [plain[k]]}, return_output_ids=True)
        assert (stopped.token_ids, stopped.finish_reason) == (plain[:k + 1], "stop")  # included, as in vLLM
        # its text is not (vLLM v1's detokenizer skips it) unless include_stop_str_in_output
        kept = client.generate(PROMPT, sampling={**GREEDY, "stop_token_ids": [plain[k]],
                                                 "include_stop_str_in_output": True}, return_output_ids=True)
        decode = load_tokenizer(None).decode
        assert stopped.text == decode(plain[:k], skip_special_tokens=True)
        assert kept.text == decode(plain[:k + 1], skip_special_tokens=True) and kept.token_ids == plain[:k + 1]
        held = client.generate(PROMPT, sampling={**GREEDY, "stop_token_ids": [plain[k]], "min_tokens": k + 1},
                               return_output_ids=True)
    assert held.token_ids[:k] == plain[:k] and held.token_ids[k] != plain[k]  # masked while under min_tokens
    assert held.finish_reason in ("stop", "length") and len(held.token_ids) > k + 1


def test_special_tokens_have_their_text_only_when_skip_special_tokens_is_false(grpc_url):
    tokenizer = load_tokenizer(None)
    special = tokenizer.convert_tokens_to_ids("<|vision_start|>")
    forced = {**GREEDY, "max_tokens": 3, "logit_bias": {str(special): 100}}
    with Client(grpc_url) as client:
        skipped = client.generate(PROMPT, sampling=forced, return_output_ids=True)
        shown = client.generate(PROMPT, sampling={**forced, "skip_special_tokens": False}, return_output_ids=True)
    assert skipped.token_ids == shown.token_ids == [special] * 3
    assert (skipped.text, shown.text) == ("", "<|vision_start|>" * 3)


@pytest.mark.parametrize("sampling,words", [
    ({"repetition_penalty": 0}, "sampling_parameters: repetition_penalty must be a finite number > 0"),
    ({"presence_penalty": 3}, "sampling_parameters: presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": -2.5}, "sampling_parameters: frequency_penalty must be in [-2, 2]"),
    ({"stop_token_ids": "7"}, "sampling_parameters: stop_token_ids must be a list of integers"),
    ({"stop_token_ids": [-1]}, "sampling_parameters: stop_token_ids must hold at most 256 token ids >= 0"),
    ({"stop_token_ids": [10**6]}, "sampling_parameters: stop_token_ids must be below the vocabulary size"),
    ({"stop_token_ids": [1e300]}, "must be below the vocabulary size 282, got 1.000e300 (an integer of 301 digits)"),
    ({"logit_bias": {"1000000": 1}}, "sampling_parameters: logit_bias's ids must be below the vocabulary size"),
    ({"logprobs": 21}, "sampling_parameters: logprobs must be in [0, 20], got 21"),
])
def test_refused_keys_are_named(grpc_url, sampling, words):
    with Client(grpc_url) as client:
        with pytest.raises(ServerError) as error:
            client.generate(PROMPT, sampling={**GREEDY, **sampling})
        assert words in str(error.value)
        assert client.generate("Still there?", sampling={"max_tokens": 2, "ignore_eos": True}).num_output_tokens == 2


def test_sampling_parameters_as_the_openai_frontend_sends_them(grpc_url):
    """Triton's OpenAI frontend (python/openai, ``_create_vllm_inference_request``) sends the request's sampling
    fields and both token-count flags; summing num_output_tokens over the responses gives the usage."""
    sampling = {"temperature": 0, "max_tokens": 6, "presence_penalty": 0.5, "frequency_penalty": 0.5}
    responses = vllm_request(grpc_url, PROMPT, sampling, return_num_input_tokens=True, return_num_output_tokens=True)
    assert sum(int(r.as_numpy("num_output_tokens")[0]) for r in responses) == 6
