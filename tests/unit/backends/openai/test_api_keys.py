"""The API's keys (backends/openai/api_keys.py): with keys set, a request without one of them is a 401 before its
body is read; the probes and CORS preflights stay open; the keys travel by the environment, never the command line.
And CORS (app.py, ``allowed_origins``), which meets them at the preflight."""
from __future__ import annotations

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from backends.openai.api_keys import ENV, ApiKeys, keys_from_env
from backends.openai.app import create_app
from backends.openai.config import ApiConfig, parse_args


@pytest.fixture
def client():
    app = FastAPI()
    bodies = []

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        bodies.append(await request.body())
        return {"ok": True}

    @app.get("/health")
    async def health():
        return {}

    app.add_middleware(ApiKeys, keys=("k1", "second-key"))
    with TestClient(app) as test_client:
        test_client.bodies = bodies
        yield test_client


@pytest.mark.parametrize("authorization, served", [
    (None, False), ("Bearer wrong", False), ("k1", False), ("Basic k1", False), ("Bearer ", False),
    ("Bearer k1", True), ("bearer k1", True), ("Bearer second-key", True),
])
def test_a_request_needs_one_of_the_keys(client, authorization, served):
    headers = {} if authorization is None else {"Authorization": authorization}
    answer = client.post("/v1/chat/completions", content=b'{"messages": []}', headers=headers)
    if served:
        assert answer.status_code == 200 and client.bodies == [b'{"messages": []}']
        return
    assert answer.status_code == 401 and client.bodies == []  # the body never reached the route
    error = answer.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    words = "send one of its keys as 'Authorization: Bearer KEY'" if authorization is None else "not one of"
    assert words in error["message"], error["message"]


def test_probes_and_preflights_need_no_key(client):
    assert client.get("/health").status_code == 200
    assert client.options("/v1/chat/completions").status_code != 401


def test_the_keys_travel_by_the_environment(monkeypatch):
    config = ApiConfig(api_keys=("k1", "k2"))
    assert "k1" not in " ".join(config.to_args()) and "k1" not in repr(config)
    assert config.env() == {ENV: "k1,k2"} and ApiConfig().env() == {}
    monkeypatch.setenv(ENV, "k1,k2")
    assert keys_from_env() == ("k1", "k2") and parse_args(config.to_args()) == config
    assert parse_args(["--api-key", "k3"]).api_keys == ("k3",)  # the option wins over the environment
    monkeypatch.setenv(ENV, "")
    assert parse_args([]).api_keys == ()


@pytest.mark.parametrize("keys", [("",), ("a,b",)])
def test_an_empty_key_or_one_with_a_comma_is_refused(keys):
    with pytest.raises(ValueError, match="api_keys must be non-empty and hold no comma"):
        ApiConfig(api_keys=keys)


PREFLIGHT = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


@pytest.mark.parametrize("origins, allowed", [(("*",), "*"), (("https://ui.example",), "https://ui.example"),
                                              (("https://other.example",), None), ((), None)])
def test_browser_pages_of_the_allowed_origins_may_call_the_api(origins, allowed):
    """CORS as vLLM's server answers it (any origin by default): the preflight is answered before the keys are
    asked for, and a refusal carries the header too, so that the page can read it."""
    app = create_app(ApiConfig(grpc_url="127.0.0.1:1", api_keys=("k1",), allowed_origins=origins))
    with TestClient(app) as client:
        preflight = client.options("/v1/chat/completions", headers=PREFLIGHT)
        refused = client.post("/v1/chat/completions", json={}, headers={"Origin": "https://ui.example"})
    assert refused.status_code == 401
    assert preflight.headers.get("access-control-allow-origin") == allowed
    assert refused.headers.get("access-control-allow-origin") == allowed
    if allowed:
        assert preflight.status_code == 200 and "authorization" in preflight.headers["access-control-allow-headers"]


def test_the_allowed_origins_option():
    assert parse_args([]).allowed_origins == ("*",) and parse_args(["--allowed-origins"]).allowed_origins == ()
    config = ApiConfig(allowed_origins=("https://a.example", "https://b.example"))
    assert parse_args(config.to_args()).allowed_origins == config.allowed_origins
