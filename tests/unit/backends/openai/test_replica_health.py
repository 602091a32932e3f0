"""/health with the replicas' gauge (backends/openai/replica_health.py, app.py): the gauge's samples read from
Prometheus text, and the app's answers against a tritonserver stand-in (its gRPC readiness calls, grpc's own server)
and a metrics endpoint (http.server), both on 127.0.0.1: 503 once every replica has ended although Triton keeps the
orchestrator READY; readiness alone when the metrics cannot be read or hold no such sample."""
from __future__ import annotations

import concurrent.futures
import http.server
import logging
import socket
import threading

import grpc
import pytest
from fastapi.testclient import TestClient
from tritonclient.grpc import service_pb2, service_pb2_grpc

from backends.openai.app import create_app
from backends.openai.config import ApiConfig
from backends.openai.replica_health import replicas_serving

HEAD = ("# HELP unifiedserve_replica_serving 1 while the replica serves\n"
        "# TYPE unifiedserve_replica_serving gauge\n")


def _text(*values: str) -> str:
    return HEAD + "".join(f'unifiedserve_replica_serving{{replica="{k}"}} {v}\n' for k, v in enumerate(values))


def test_every_replica_at_0_is_not_serving_and_one_at_1_is():
    assert replicas_serving(_text("0", "0")) is False
    assert replicas_serving(_text("0", "1")) is True
    assert replicas_serving(_text("1")) is True
    assert replicas_serving("unifiedserve_replica_serving 0\r\n") is False  # unlabelled, CRLF
    assert replicas_serving('unifiedserve_replica_serving{replica="0"} 1 1733475000000\n') is True  # a timestamp


def test_without_the_gauge_it_is_unknown():
    assert replicas_serving("") is None
    assert replicas_serving(HEAD) is None  # comments are not samples
    assert replicas_serving('nv_inference_count{model="orchestrator"} 0\nunifiedserve_kv_pages_free 12\n') is None


def test_garbage_and_other_metrics_of_the_same_prefix_are_ignored():
    text = ("unifiedserve_replica_serving{replica=\"0\"} not-a-number\n"
            "unifiedserve_replica_serving{replica=\"1\"} NaN\n"
            "unifiedserve_replica_serving_total 1\n"  # another metric whose name begins with it
            "unifiedserve_replica_servingx{replica=\"0\"} 1\n"
            "unifiedserve_replica_serving{replica=\"2\"\n"  # cut short: no value
            "# unifiedserve_replica_serving 1\n"
            "  unifiedserve_replica_serving 1\n"  # not at the line's start
            "\x00\xff garbage {}} 1\n")
    assert replicas_serving(text) is None
    assert replicas_serving(text + 'unifiedserve_replica_serving{replica="3"} 0\n') is False
    assert replicas_serving(text + 'unifiedserve_replica_serving{replica="3"} 1.0e0\n') is True


class _Triton(service_pb2_grpc.GRPCInferenceServiceServicer):
    """tritonserver's readiness calls: the server ready, the ``orchestrator`` model while ``model_ready``."""

    model_ready = True

    def ServerReady(self, request, context):  # noqa: N802 (the service's names)
        return service_pb2.ServerReadyResponse(ready=True)

    def ModelReady(self, request, context):  # noqa: N802
        return service_pb2.ModelReadyResponse(ready=self.model_ready and request.name == "orchestrator")


class _Metrics(http.server.BaseHTTPRequestHandler):
    """Triton's metrics endpoint: ``/metrics`` answers ``status`` with ``body``."""

    status, body = 200, _text("1")

    def do_GET(self):  # noqa: N802
        payload = self.body.encode()
        self.send_response(self.status if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def triton():
    servicer, server = _Triton(), grpc.server(concurrent.futures.ThreadPoolExecutor(4))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


@pytest.fixture(scope="module")
def metrics_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()


@pytest.fixture
def served(triton, monkeypatch):
    """The stand-ins' state, set back after each test."""
    servicer, _ = triton
    for owner, name in ((servicer, "model_ready"), (_Metrics, "status"), (_Metrics, "body")):
        monkeypatch.setattr(owner, name, getattr(owner, name))
    return servicer


def _statuses(client: TestClient) -> set[int]:
    return {client.get("/health").status_code, client.get("/ping").status_code, client.post("/ping").status_code}


def test_health_is_503_once_every_replica_has_ended_though_the_orchestrator_is_ready(triton, metrics_url, served):
    config = ApiConfig(grpc_url=triton[1], token_channel=False, metrics_url=metrics_url)
    with TestClient(create_app(config)) as client:
        assert _statuses(client) == {200}
        _Metrics.body = _text("0", "1")  # one replica left
        assert _statuses(client) == {200}
        _Metrics.body = _text("0", "0")
        assert _statuses(client) == {503}
        _Metrics.body = _text("1", "1")
        served.model_ready = False  # not ready: 503 whatever the gauge says
        assert _statuses(client) == {503}
    with TestClient(create_app(ApiConfig(grpc_url=triton[1], token_channel=False))) as client:
        served.model_ready, _Metrics.body = True, _text("0", "0")
        assert _statuses(client) == {200}  # no metrics URL: readiness alone


def test_metrics_without_the_gauge_or_not_served_leave_readiness_the_answer(triton, metrics_url, served, caplog):
    config = ApiConfig(grpc_url=triton[1], token_channel=False, metrics_url=metrics_url)
    with TestClient(create_app(config)) as client, caplog.at_level(logging.WARNING, "backends.openai.replica_health"):
        _Metrics.body = "# HELP nv_inference_count x\nnv_inference_count 3\n"
        assert _statuses(client) == {200}
        _Metrics.status, _Metrics.body = 500, _text("0")
        assert _statuses(client) == {200}
    assert len(caplog.records) == 1 and "list no unifiedserve_replica_serving" in caplog.records[0].getMessage()


def test_metrics_that_cannot_be_fetched_leave_readiness_the_answer_with_one_warning(triton, served, caplog):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]  # nothing listens there once the probe is closed
    config = ApiConfig(grpc_url=triton[1], token_channel=False, metrics_url=f"http://127.0.0.1:{closed}/metrics")
    with TestClient(create_app(config)) as client, caplog.at_level(logging.WARNING, "backends.openai.replica_health"):
        assert _statuses(client) == {200}
        assert client.get("/health").status_code == 200
    assert len(caplog.records) == 1, caplog.records  # once per process, not per check
    assert caplog.records[0].getMessage().startswith(f"cannot read Triton's metrics at http://127.0.0.1:{closed}/")
