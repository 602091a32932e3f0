"""Errors of the OpenAI-compatible API (backends/openai) beside a real tritonserver: in OpenAI's shape with their HTTP
status and the field at fault, whole and streamed, and the server serving on after them; vLLM's rule for a request
without a model."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from tests.e2e.test_openai_api import MODEL, api, sdk  # noqa: F401 (api, sdk: the fixtures)

pytestmark = pytest.mark.e2e


BAD = [
    # (what, create() keyword arguments, HTTP status, error param, words the message must hold)
    ("an image that is not an image",
     dict(messages=[{"role": "user", "content": [{"type": "image_url",
                                                  "image_url": {"url": "data:image/png;base64,R0lGODlh"}}]}]),
     400, "messages", "image_url: not a decodable image"),
    ("an unknown model", dict(model="gpt-4o"), 404, "model", "`gpt-4o` does not exist"),
    ("max_tokens 0", dict(max_tokens=0), 400, "max_tokens", "max_tokens must be a positive integer"),
    ("a file outside the allowed folders",
     dict(messages=[{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "file:///etc/passwd"}}]}]),
     400, "messages", "outside the allowed media folders"),
    ("an http URL (not allowed by default)",
     dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]),
     400, "messages", "messages[0].content[0].image_url: http(s) URLs are not fetched"),
    ("no choices", dict(n=0), 400, "n", "n: must be in [1, 128], got 0"),
    ("beam search", dict(extra_body={"use_beam_search": True}), 400, "use_beam_search",
     "use_beam_search: beam search is not supported"),
    ("a priority", dict(extra_body={"priority": 1}), 400, "priority",
     "priority: got 1 but priority scheduling is not enabled"),
    ("an image in an assistant message",
     dict(messages=[{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]),
     400, "messages", "messages[1].content[0]: image parts are allowed in user messages only"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("what,kwargs,status,param,words", BAD, ids=[b[0] for b in BAD])
def test_errors_come_in_openais_shape(sdk, what, kwargs, status, param, words, stream):
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **kwargs}
    with pytest.raises(openai.APIStatusError) as error:
        sdk.chat.completions.create(stream=stream, **request)
    assert error.value.status_code == status, f"{what}: {error.value}"
    body = error.value.body
    assert set(body) == {"message", "type", "param", "code"} and body["param"] == param, body
    assert words in body["message"] and body["type"] == "invalid_request_error", body
    assert sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Still there?"}],
                                       max_tokens=2).choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("stream", ["false", "true"])
@pytest.mark.parametrize("path, fields, param, words", [
    ("chat/completions", '"messages": [{"role": "user", "content": "Hi \\ud800"}]', "messages",
     "messages[0].content: not valid Unicode text"),
    ("completions", '"prompt": "Once \\ud800 upon"', "prompt", "prompt: the prompt is not valid UTF-8"),
], ids=["chat", "completion"])
def test_a_lone_surrogate_in_the_text_is_400(api, stream, path, fields, param, words):
    """JSON's escape of a lone UTF-16 surrogate decodes to no text (the SDK cannot even send it; curl can)."""
    body = f'{{"model": "{MODEL}", "max_tokens": 2, "stream": {stream}, {fields}}}'.encode()
    request = urllib.request.Request(f"{api.url}/v1/{path}", data=body, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=30)
    answer = json.loads(error.value.read())["error"]
    assert error.value.code == 400 and answer["param"] == param and words in answer["message"], answer


@pytest.mark.parametrize("path, fields", [("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                                          ("completions", {"prompt": "Once upon"})], ids=["chat", "completion"])
@pytest.mark.parametrize("model", [None, ""], ids=["absent", "empty"])
def test_a_request_without_a_model_is_for_the_served_one(api, path, fields, model):
    """vLLM's rule: ``model`` left out (or empty) means the served model; the answer names it."""
    body = {"max_tokens": 2, **fields, **({} if model is None else {"model": model})}
    request = urllib.request.Request(f"{api.url}/v1/{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        reply = json.loads(answer.read())
    assert reply["model"] == MODEL and reply["usage"]["completion_tokens"] >= 1, reply
