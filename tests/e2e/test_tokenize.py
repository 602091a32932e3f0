"""vLLM's ``/tokenize``, ``/detokenize`` and ``/version`` on the OpenAI API, and the orchestrator's ``tokenize_only``
input under them, through a real tritonserver: a conversation with an image tokenizes to transformers' chat template
with the image's visual tokens (the count its chat completion reports), a prompt to the tokenizer's ids, ids back to
its text; nothing runs (no request metric moves, no page is held); bad input is refused by name."""
from __future__ import annotations

import json
import queue
import re
import urllib.request
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from backends.openai.process import ApiProcess
from client.api import grpc_inputs
from client.http_stream import iter_sse_data, piece_from_event
from client.pieces import is_final, piece_from_grpc
from orchestrator.inputs import MediaInput
from orchestrator.media import plan_media
from orchestrator.prompt import QWEN
from orchestrator.sampling_params import RequestParams
from tests.e2e.conftest import metrics_text, read_metrics, settled
from tests.e2e.test_openai_api import _data_url, api  # noqa: F401 (api: the fixture)
from tests.e2e.test_token_prompts import hf  # noqa: F401 (the fixture: the tiny model and its tokenizer)
from tests.media import make_image

pytestmark = pytest.mark.e2e
TEXT = "Once upon a time there was"


def post(api: ApiProcess, path: str, body: dict) -> tuple[int, dict]:
    response = httpx.post(f"{api.url}{path}", content=json.dumps(body), timeout=120,  # ASCII: a lone surrogate too
                          headers={"Content-Type": "application/json"})
    return response.status_code, response.json()


def test_a_conversation_with_an_image_tokenizes_to_the_chat_template_and_its_visual_tokens(api, hf):
    """The ids are the tokenizer's chat template over the conversation with the image's placeholder repeated for its
    visual tokens (flashcodec's plan), the count the same chat's completion reports as its prompt tokens;
    ``mm_processor_kwargs`` change it as they change the completion's; the tokens' strings are the tokenizer's."""
    _, tokenizer = hf
    image = make_image(96, 64, "RGB", "PNG")
    part = {"type": "image_url", "image_url": {"url": _data_url(image, "image/png")}}
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "Now this:"}, part]}]
    status, tokens = post(api, "/tokenize", {"messages": messages, "return_token_strs": True})
    template = [messages[0], {"role": "user", "content": [{"type": "text", "text": "Now this:"}, {"type": "image"}]}]
    ids = tokenizer.apply_chat_template(template, tokenize=True, add_generation_prompt=True, return_dict=False)
    grid = plan_media(MediaInput("image", data=image), RequestParams(), QWEN).grid_thw
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    ids = [t for token in ids for t in ([token] * (grid[1] * grid[2] // 4) if token == pad else [token])]
    assert status == 200 and tokens["tokens"] == ids and tokens["count"] == len(ids)
    assert tokens["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    assert tokens["max_model_len"] == 32768  # the tiny preset's
    status, chat = post(api, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert status == 200 and chat["usage"]["prompt_tokens"] == len(ids)
    larger = {"min_pixels": 200704}  # resized up: more visual tokens
    status, more = post(api, "/tokenize", {"messages": messages, "mm_processor_kwargs": larger})
    status_chat, chat = post(api, "/v1/chat/completions",
                             {"messages": messages, "max_tokens": 1, "mm_processor_kwargs": larger})
    assert status == status_chat == 200 and more["count"] == chat["usage"]["prompt_tokens"] > len(ids)
    assert more["token_strs"] is None  # not asked
    status, plain = post(api, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert status == 200 and plain["tokens"] == ids[:-len(tokenizer.encode("<|im_start|>assistant\n"))]
    # its ids back to text, the image's placeholders too (tokens only the server places in a prompt)
    assert post(api, "/detokenize", {"tokens": ids}) == (200, {"prompt": tokenizer.decode(ids)})


def test_a_prompt_tokenizes_as_it_is_and_ids_detokenize_to_their_text(api, hf):
    _, tokenizer = hf
    status, tokens = post(api, "/tokenize", {"prompt": TEXT, "add_special_tokens": True})
    assert status == 200 and tokens["tokens"] == tokenizer.encode(TEXT) and tokens["token_strs"] is None
    status, text = post(api, "/detokenize", {"tokens": tokens["tokens"]})
    assert (status, text) == (200, {"prompt": TEXT})
    ids = tokenizer.encode("<|im_start|>user") + [tokens["tokens"][0]]  # special tokens are kept, as vLLM's are
    assert post(api, "/detokenize", {"tokens": ids}) == (200, {"prompt": tokenizer.decode(ids)})
    assert post(api, "/detokenize", {"tokens": []}) == (200, {"prompt": ""})
    long = " ".join([TEXT] * 400)  # over 4,096 ids: its response is built off the orchestrator's event loop
    status, tokens = post(api, "/tokenize", {"prompt": long, "return_token_strs": True})
    assert status == 200 and tokens["tokens"] == tokenizer.encode(long) and tokens["count"] > 4096
    assert tokens["token_strs"] == tokenizer.convert_ids_to_tokens(tokens["tokens"])


def test_version_is_the_projects(api):
    version = re.search(r'^version = "(.+)"$', (Path(__file__).parents[2] / "pyproject.toml").read_text(),
                        re.MULTILINE).group(1)
    response = httpx.get(f"{api.url}/version", timeout=30)
    assert response.status_code == 200 and response.json() == {"version": version}


@pytest.mark.parametrize("path, body, param, says", [
    ("/detokenize", {"tokens": [5, 10**6]}, "tokens", "tokens: id 1000000 (position 1) is outside the vocabulary"),
    ("/detokenize", {"tokens": [2**63]}, "tokens", "tokens: token id 9223372036854775808 is not in [0, 2**63)"),
    ("/detokenize", {"tokens": "5"}, "tokens", "tokens: Input should be a valid list"),
    ("/tokenize", {}, "prompt", "prompt: Field required"),
    ("/tokenize", {"prompt": ["a", "b"]}, "prompt", "prompt: Input should be a valid string"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ x }}"}, "chat_template",
     "chat_template: this server applies its own template only (see --chat-template)"),
    ("/tokenize", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     "messages", "messages[0].content[0].image_url: not a decodable image"),
    ("/tokenize", {"model": "other", "prompt": "x"}, "model", "The model `other` does not exist"),
    ("/detokenize", {"model": "\ud800", "tokens": [5]}, "model", "The model `\\ud800` does not exist"),
])
def test_bad_input_is_refused_by_name(api, path, body, param, says):
    status, answer = post(api, path, body)
    assert status == (404 if param == "model" else 400), answer
    assert answer["error"]["param"] == param and answer["error"]["message"].startswith(says), answer


def tokenize_only(grpc_url: str, **inputs: np.ndarray):
    """One ``tokenize_only`` request of ``inputs`` over gRPC's stream: (its one response, None), or (None, the
    error)."""
    tensors = [("tokenize_only", np.array([True]))] + list(inputs.items())
    responses: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(grpc_url) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        try:
            client.async_stream_infer("orchestrator", grpc_inputs(
                [(name, array, {"b": "BOOL", "i": "INT64"}.get(array.dtype.kind, "BYTES")) for name, array in tensors]))
            result, error = responses.get(timeout=120)
            assert error is not None or is_final(result)  # one response, the last
            return result, error
        finally:
            client.stop_stream()


def test_tokenize_only_runs_nothing_and_answers_once(grpc_url, server, hf):
    """The KServe input itself: one final response with ``input_ids``, ``input_tokens`` (unless
    ``return_input_tokens`` is false) and ``num_input_tokens`` (``prompt_text`` for token ids); no request is counted
    (nor refused ones) or run and no KV page is held; a ``token_channel`` beside it is refused by name."""
    _, tokenizer = hf
    counted = ("unifiedserve_prompt_tokens_total", "unifiedserve_scheduler_steps_total",
               "unifiedserve_e2e_request_latency_seconds_count")

    def requests() -> list:  # the counters of a generation, and every request_success_total (refusals too)
        return [read_metrics(server).get(name) for name in counted] + [
            line for line in metrics_text(server).splitlines() if line.startswith("unifiedserve_request_success")]
    before = settled(requests)  # earlier tests' sums arrived
    result, error = tokenize_only(grpc_url, text_input=np.array([TEXT.encode()], dtype=np.object_))
    piece = piece_from_grpc(result)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": TEXT}], tokenize=True,
                                        add_generation_prompt=True, return_dict=False)
    assert error is None and piece.final and piece.input_ids == tuple(ids) and piece.num_input_tokens == len(ids)
    assert piece.input_tokens == tuple(tokenizer.convert_ids_to_tokens(ids)) and piece.text == b""
    result, error = tokenize_only(grpc_url, prompt_token_ids=np.array(ids, dtype=np.int64))
    assert error is None and json.loads(result.as_numpy("prompt_text")[0]) == tokenizer.decode(ids)
    assert result.as_numpy("input_tokens") is not None  # by default
    result, error = tokenize_only(grpc_url, prompt_token_ids=np.array(ids, dtype=np.int64),
                                  return_input_tokens=np.array([False]))
    assert error is None and result.as_numpy("input_tokens") is None  # left out when asked (the API's /detokenize)
    assert list(result.as_numpy("input_ids")) == ids
    _, error = tokenize_only(grpc_url, prompt_token_ids=np.array([10**6], dtype=np.int64))
    assert error is not None and "outside the vocabulary" in str(error)
    assert settled(requests) == before  # its refusal is no generation's either
    metrics = read_metrics(server)
    assert metrics["unifiedserve_kv_pages_free"] == metrics["unifiedserve_kv_pages_total"]
    _, error = tokenize_only(grpc_url, text_input=np.array([b"x"], dtype=np.object_),
                             token_channel=np.array([b"any"], dtype=np.object_))
    assert error is not None and "token_channel: a tokenize_only request is answered on its own stream" in str(error)


def test_return_input_ids_puts_the_prompt_as_it_runs_on_the_first_response(grpc_url, http_url):
    """``return_input_ids`` (vLLM's ``prompt_token_ids``, which the OpenAI API's ``return_token_ids`` asks for): an
    HTTP generate_stream's first event carries ``input_ids``, the ids ``tokenize_only`` gives for the same inputs
    (chat template, the image's visual tokens expanded), and no later event does."""
    image = _data_url(make_image(96, 64, "RGB", "PNG"), "image/png")
    inputs = {"text_input": TEXT, "image_url": [image]}
    result, error = tokenize_only(grpc_url, **{name: np.array([v.encode() for v in ([value] if isinstance(
        value, str) else value)], dtype=np.object_) for name, value in inputs.items()})
    assert error is None
    expected = piece_from_grpc(result).input_ids
    body = {**inputs, "return_input_ids": True, "sampling_parameters": json.dumps({"max_tokens": 3,
                                                                                   "ignore_eos": True}),
            "stream": True}
    request = urllib.request.Request(f"http://{http_url}/v2/models/orchestrator/generate_stream",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        pieces = [piece_from_event(json.loads(data)) for data in iter_sse_data(answer)]
    assert len(pieces) >= 2 and len(expected) > 60 and pieces[0].input_ids == expected
    assert all(piece.input_ids is None for piece in pieces[1:])
