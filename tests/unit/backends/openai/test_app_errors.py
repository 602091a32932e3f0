"""The app's answers that need no tritonserver (backends/openai/app.py, errors.py): every error in OpenAI's shape
and status, and 503 while the server cannot be reached (its gRPC address has no listener)."""
from __future__ import annotations

import socket
import warnings

import pytest
from fastapi.testclient import TestClient

from backends.openai.app import create_app
from backends.openai.config import ApiConfig


@pytest.fixture(scope="module")
def client():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with TestClient(create_app(ApiConfig(grpc_url=f"127.0.0.1:{port}"))) as c:
        yield c


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize("body,param,words", [
    ({"model": "m"}, "messages", "messages: Field required"),
    ({"model": "m", "messages": []}, "messages", "messages: List should have at least 1 item"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}, "max_tokens",
     "max_tokens: Input should be a valid integer"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages", "messages[0].content[0].image_url.url: Field required"),
    ({"model": "m", "messages": [{"role": "function", "content": "x"}]}, "messages",
     "messages[0].role: Input should be 'system', 'developer', 'user', 'assistant' or 'tool'"),
    # values vLLM's request models cannot convert either (pydantic's lax mode)
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "ignore_eos": "maybe"}, "ignore_eos",
     "ignore_eos: Input should be a valid boolean, unable to interpret input"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2.5}, "max_tokens",
     "max_tokens: Input should be a valid integer, got a number with a fractional part"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": [True]}, "stream",
     "stream: Input should be a valid boolean"),
    # a union's branches said once, with what came
    ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages",
     "messages[0].content: Input should be a valid string or list (got 5)"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": 5}, "stop",
     "stop: Input should be a valid string or list (got 5)"),
    # a malformed tool, or tool call of the history (backends/openai/tools.py)
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {}}]}, "tools",
     "tools[1].function.name: Field required"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "code", "function": {"name": "f"}}]}, "tools", "tools[0].type: Input should be 'function'"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [
        {"function": {"name": "f", "parameters": "{}"}}]}, "tools",
     "tools[0].function.parameters: Input should be a valid dictionary"),
    ({"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "messages", "messages[0].tool_calls[0].function.name: Field required"),
])
def test_a_body_that_fails_validation_is_400(client, body, param, words):
    error = _error(client.post("/v1/chat/completions", json=body), 400)
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"], error["message"]


@pytest.mark.parametrize("prompt,words", [
    (None, "prompt: Input should be a valid string or list (got null)"),
    ([1.5], "prompt[0]: Input should be a valid string, integer or list (got 1.5)"),
    ([[1, "a"]], "prompt[0][1]: Input should be a valid integer, unable to parse string as an integer"),
])
def test_a_bad_prompt_is_told_once_what_it_should_be(client, prompt, words):
    error = _error(client.post("/v1/completions", json={"model": "m", "prompt": prompt}), 400)
    assert error["param"] == "prompt" and error["message"] == words


def test_a_body_that_is_not_json_is_400(client):
    error = _error(client.post("/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"}),
                   400)
    assert error["message"].startswith("the body is not valid JSON")


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded", "text/json", None])
def test_a_json_body_sent_as_another_content_type_is_400_naming_it(client, kind):
    body = b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}'
    error = _error(client.post("/v1/chat/completions", content=body, headers={"content-type": kind} if kind else {}),
                   400)
    got = repr(kind) if kind else "no Content-Type"
    assert error["message"] == f"the body must be JSON, sent with Content-Type: application/json (got {got})"


def test_an_empty_body_is_400_as_missing(client):
    error = _error(client.post("/v1/chat/completions", content=b"", headers={"content-type": "text/plain"}), 400)
    assert "Field required" in error["message"], error


def test_a_json_content_type_with_parameters_or_a_suffix_is_parsed(client):
    body = b'{"model": "m", "messages": []}'
    for kind in ("application/json; charset=utf-8", "application/vnd.api+json"):
        error = _error(client.post("/v1/chat/completions", content=body, headers={"content-type": kind}), 400)
        assert error["param"] == "messages", (kind, error)


def test_a_body_that_is_not_utf8_is_400_naming_the_byte(client):
    body = b'{"model": "m", "messages": [{"role": "user", "content": "caf\xe9"}]}'
    error = _error(client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"}),
                   400)
    assert error["message"] == "the body is not valid UTF-8 JSON: byte 0xe9 at offset 60 (invalid continuation byte)"


def test_a_body_nested_past_the_json_parsers_limit_is_400_saying_so(client):
    """FastAPI turns json's RecursionError into "There was an error parsing the body" (a fresh user's
    response_format schema 500 objects deep)."""
    body = b'{"model": "m", "messages": [], "response_format": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    error = _error(client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"}),
                   400)
    assert error["message"].startswith("the body's JSON holds arrays or objects nested too deep"), error


def test_unknown_paths_and_methods(client):
    assert _error(client.get("/v1/nothing"), 404)["message"] == "Not Found"
    assert _error(client.get("/v1/chat/completions"), 405)["type"] == "invalid_request_error"


def test_without_a_server_everything_else_is_503(client):
    assert client.get("/health").status_code == 503
    assert client.get("/ping").status_code == client.post("/ping").status_code == 503  # vLLM's name for it
    assert _error(client.get("/v1/models"), 503)["code"] == "service_unavailable"
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert _error(client.post("/v1/chat/completions", json=body), 503)["type"] == "server_error"


def test_a_body_over_the_limit_is_413_before_it_is_read():
    """``max_body_bytes``: a body whose Content-Length passes it, or a chunked one whose bytes do, is answered 413
    (OpenAI's error shape, ``code`` ``request_too_large``); one within it goes on (here to the 503 of an unreachable
    server)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    body = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 2000 + b'"}]}'
    with TestClient(create_app(ApiConfig(grpc_url=f"127.0.0.1:{port}", max_body_bytes=1000))) as limited:
        error = _error(limited.post("/v1/chat/completions", content=body,
                                    headers={"content-type": "application/json"}), 413)
        assert error["code"] == "request_too_large" and "limit of 1000 bytes" in error["message"]

        for cuts in ([600], [600, 1200]):  # over the limit in the last chunk; before it (the rest read and dropped)
            def chunks():  # no Content-Length: the bytes are counted as they are read
                yield from (body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)]))
            error = _error(limited.post("/v1/chat/completions", content=chunks(),
                                        headers={"content-type": "application/json"}), 413)
            assert error["code"] == "request_too_large"
    with TestClient(create_app(ApiConfig(grpc_url=f"127.0.0.1:{port}", max_body_bytes=len(body)))) as roomy:
        assert roomy.post("/v1/chat/completions", content=body,
                          headers={"content-type": "application/json"}).status_code == 503


def test_a_client_that_expects_100_continue_gets_the_413_at_once():
    """Content-Length over the limit and ``Expect: 100-continue``: the 413 without reading (the client sends no
    body until told to, so a read would wait; an app behind the limit is not called)."""
    import asyncio

    from backends.openai.body_limit import BodyLimit

    async def never() -> dict:
        await asyncio.Event().wait()
        return {}

    async def app(scope, receive, send):
        raise AssertionError("the app was called")

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "headers": [(b"content-length", b"5000"), (b"expect", b"100-continue")]}
    asyncio.run(asyncio.wait_for(BodyLimit(app, 1000)(scope, never, send), 5))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 413


def test_the_openapi_document_is_built_without_a_warning(client):
    """Every route has an operation id of its own (``/ping``'s GET and POST shared one: FastAPI warned of a duplicate
    on each build of /openapi.json)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        document = client.get("/openapi.json").json()
    assert {"get", "post"} <= set(document["paths"]["/ping"])
