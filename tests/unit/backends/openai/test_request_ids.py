"""Request ids as vLLM gives them (backends/openai/request_ids.py): the reply id's base and the X-Request-Id header
that --enable-request-id-headers puts on every answer (here on answers that need no tritonserver)."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from starlette.requests import Request

from backends.openai.app import create_app
from backends.openai.config import ApiConfig
from backends.openai.request_ids import reply_id


def _request(headers: dict[str, str]) -> Request:
    return Request({"type": "http", "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]})


def test_the_header_wins_over_the_bodys_request_id():
    assert reply_id(_request({"X-Request-Id": "job-7"}), "b-1") == "job-7"
    assert reply_id(_request({}), "b-1") == "b-1"
    assert reply_id(_request({}), None) is None  # the shape then draws a random one


@pytest.mark.parametrize("on", [False, True])
def test_every_answer_carries_the_header_only_when_asked(on):
    app = create_app(ApiConfig(grpc_url="127.0.0.1:1", api_keys=("k1",), request_id_headers=on))
    with TestClient(app) as client:
        refused = client.post("/v1/chat/completions", json={}, headers={"X-Request-Id": "job-7"})  # 401: no key
        missing = client.get("/no/such/path", headers={"Authorization": "Bearer k1"})
        drawn = [client.get("/no/such/path", headers={"Authorization": "Bearer k1"}) for _ in range(2)]
    assert refused.status_code == 401 and missing.status_code == 404
    if not on:
        assert "x-request-id" not in refused.headers and "x-request-id" not in missing.headers
        return
    assert refused.headers["x-request-id"] == "job-7"
    ids = [answer.headers["x-request-id"] for answer in drawn]
    assert ids[0] != ids[1] and all(len(i) == 32 for i in ids)  # a random hex string each, as vLLM's uuid4().hex
