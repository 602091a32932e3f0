"""``GET /metrics`` on the API's port (backends/openai/metrics_route.py): Triton's metrics text passed through as
it is fetched now, 502 naming the URL when it cannot be read, 404 naming --metrics-url without one; no API key
needed. Against a real tritonserver: tests/e2e/test_openai_api.py."""
from __future__ import annotations

from fastapi.testclient import TestClient

from backends.openai.app import create_app
from backends.openai.config import ApiConfig
from tests.unit.backends.openai.test_replica_health import MetricsEndpoint, metrics_endpoint, replica_gauges

GRPC = "127.0.0.1:1"  # never connected: /metrics does not reach the orchestrator


def test_the_metrics_text_is_triton_metrics_ports_fetched_now_without_a_key():
    with metrics_endpoint() as url, TestClient(create_app(ApiConfig(grpc_url=GRPC, metrics_url=url,
                                                                    api_keys=("sk-test",)))) as client:
        for body in (replica_gauges("1"), replica_gauges("1") + "unifiedserve_kv_pages_free 7\n"):
            MetricsEndpoint.body = body
            answer = client.get("/metrics")
            assert (answer.status_code, answer.text) == (200, body)
            assert answer.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        MetricsEndpoint.status = 500
        answer = client.get("/metrics")
    assert answer.status_code == 502 and answer.json()["error"]["message"].startswith(
        f"/metrics: Triton's metrics at {url} cannot be read (HTTPStatusError")


def test_without_a_metrics_url_it_is_a_404_naming_the_option():
    with TestClient(create_app(ApiConfig(grpc_url=GRPC))) as client:
        answer = client.get("/metrics")
    assert answer.status_code == 404 and "--metrics-url" in answer.json()["error"]["message"]
