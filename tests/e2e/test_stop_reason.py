"""What ended a reply, through tritonserver: vLLM's ``stop_reason`` (the stop string, or the id of the stop token,
that ended the output; null for the tokenizer's eos and any other end) on the orchestrator's last response and on
the OpenAI API's choices, whole and streamed; and the API's chunks in OpenAI's shape (``finish_reason`` null until a
choice's last chunk, the role on its first delta only)."""
from __future__ import annotations

import json

import httpx
import pytest

from client.api import Client
from tests.e2e.conftest import openai_sdk

pytestmark = pytest.mark.e2e
PROMPT = "Write a long story about a cat."
GREEDY = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def sdk(server, tmp_path_factory):
    with openai_sdk(server, tmp_path_factory.mktemp("openai")) as client:
        yield client


@pytest.fixture(scope="module")
def plain(grpc_url):
    """The greedy reply with nothing to stop it (the dummy model's text and ids)."""
    with Client(grpc_url) as client:
        reply = client.generate(PROMPT, sampling=GREEDY, return_output_ids=True)
    assert reply.finish_reason == "length" and reply.stop_reason is None
    return reply


def _stop_string(text: str) -> str:
    """A piece of ``text`` after its second character, of up to four characters and no replacement character (the
    dummy model's reply splits many), found nowhere before."""
    return next(text[k:k + n] for n in (4, 3, 2, 1) for k in range(2, len(text) - n)
                if "\ufffd" not in text[k:k + n] and text[k:k + n] not in text[:k + n - 1])


def _stop_token(reply) -> int:
    """A token of ``reply`` (anything with ``token_ids``) first made after its second."""
    ids = list(reply.token_ids)
    return ids[next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_last_response_names_the_stop_string_or_token(grpc_url, plain, stream):
    with Client(grpc_url) as client:
        by_string = client.generate(PROMPT, sampling={**GREEDY, "stop": ["nowhere", _stop_string(plain.text)]},
                                    stream=stream)
        by_token = client.generate(PROMPT, sampling={**GREEDY, "stop_token_ids": [_stop_token(plain)]}, stream=stream)
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", _stop_string(plain.text))
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", _stop_token(plain))


def test_the_openai_choices_carry_the_stop_reason_whole_and_streamed(sdk):
    completion = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                  "extra_body": {"ignore_eos": True}}
    stop = _stop_string(sdk.completions.create(**completion).choices[0].text)
    whole = sdk.completions.create(**completion, stop=[stop])
    assert (whole.choices[0].finish_reason, whole.choices[0].model_extra["stop_reason"]) == ("stop", stop)
    messages = [{"role": "user", "content": PROMPT}]
    chat = sdk.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
    token = _stop_token(chat)
    chunks = [c for c in sdk.chat.completions.create(
        model="tiny", messages=messages, max_tokens=24, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "stop_token_ids": [token]}) if c.choices]
    choices = [c.choices[0] for c in chunks]
    assert (choices[-1].finish_reason, choices[-1].model_extra["stop_reason"]) == ("stop", token)
    assert all(c.model_extra["stop_reason"] is None for c in choices[:-1])
    length = sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=2,
                                         extra_body={"ignore_eos": True})
    assert length.choices[0].finish_reason == "length" and length.choices[0].model_extra["stop_reason"] is None


@pytest.mark.parametrize("route", ["chat/completions", "completions"])
def test_every_streamed_chunk_has_openais_fields_finish_reason_null_until_the_last(sdk, route):
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "stream": True, "ignore_eos": True,
            **({"messages": [{"role": "user", "content": PROMPT}]} if route.startswith("chat") else {"prompt": PROMPT})}
    with httpx.stream("POST", f"{sdk.base_url}{route}", json=body, timeout=120) as response:
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    choices = [choice for event in events[:-1] for choice in json.loads(event)["choices"]]
    assert all({"index", "logprobs", "finish_reason"} <= set(choice) for choice in choices)
    assert [choice["finish_reason"] for choice in choices[:-1]] == [None] * (len(choices) - 1)
    assert choices[-1]["finish_reason"] == "length" and not any("token_ids" in choice for choice in choices)
    if route.startswith("chat"):
        assert choices[0]["delta"]["role"] == "assistant" and all("role" not in c["delta"] for c in choices[1:])
