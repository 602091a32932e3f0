"""The replicas' gauge for /health (backends/openai/replica_health.py): its samples read from Prometheus text, and
fetched from a metrics endpoint (http.server on 127.0.0.1); unknown, with one warning, when the metrics cannot be
read or hold no such sample. /health itself against a real tritonserver: tests/e2e/test_openai_api.py."""
from __future__ import annotations

import asyncio
import contextlib
import http.server
import logging
import socket
import threading
from typing import Iterator

import pytest

from backends.openai.replica_health import ReplicaHealth, replicas_serving

HEAD = ("# HELP unifiedserve_replica_serving 1 while the replica serves\n"
        "# TYPE unifiedserve_replica_serving gauge\n")


def replica_gauges(*values: str) -> str:
    return HEAD + "".join(f'unifiedserve_replica_serving{{replica="{k}"}} {v}\n' for k, v in enumerate(values))


def test_every_replica_at_0_is_not_serving_and_one_at_1_is():
    assert replicas_serving(replica_gauges("0", "0")) is False
    assert replicas_serving(replica_gauges("0", "1")) is True
    assert replicas_serving(replica_gauges("1")) is True
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


class MetricsEndpoint(http.server.BaseHTTPRequestHandler):
    """Triton's metrics endpoint: ``/metrics`` answers ``status`` with ``body``."""

    status, body = 200, replica_gauges("1")

    def do_GET(self):  # noqa: N802
        payload = self.body.encode()
        self.send_response(self.status if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def metrics_endpoint() -> Iterator[str]:
    """A :class:`MetricsEndpoint` on 127.0.0.1 while the block runs: its URL; its answer set back after it."""
    answer = (MetricsEndpoint.status, MetricsEndpoint.body)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), MetricsEndpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()
        MetricsEndpoint.status, MetricsEndpoint.body = answer


@pytest.fixture
def metrics_url():
    with metrics_endpoint() as url:
        yield url


def _serving(health: ReplicaHealth) -> list[bool | None]:
    async def twice():
        try:
            return [await health.serving(), await health.serving()]
        finally:
            await health.close()
    return asyncio.run(twice())


def test_the_fetched_gauge_says_whether_a_replica_serves(metrics_url):
    for body, expected in ((replica_gauges("0", "1"), True), (replica_gauges("0", "0"), False)):
        MetricsEndpoint.body = body
        assert _serving(ReplicaHealth(metrics_url)) == [expected, expected]


def test_metrics_without_the_gauge_or_not_served_are_unknown_with_one_warning(metrics_url, caplog):
    with caplog.at_level(logging.WARNING, "backends.openai.replica_health"):
        MetricsEndpoint.body = "# HELP nv_inference_count x\nnv_inference_count 3\n"
        assert _serving(ReplicaHealth(metrics_url)) == [None, None]
        MetricsEndpoint.status, MetricsEndpoint.body = 500, replica_gauges("0")
        assert _serving(ReplicaHealth(metrics_url)) == [None, None]
    messages = [r.getMessage() for r in caplog.records]  # once per ReplicaHealth (an API process's), not per check
    assert len(messages) == 2, messages
    assert messages[0].startswith(f"Triton's metrics at {metrics_url} list no unifiedserve_replica_serving")
    assert messages[1].startswith(f"cannot read Triton's metrics at {metrics_url} (HTTPStatusError")


def test_metrics_that_cannot_be_fetched_are_unknown(caplog):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]  # nothing listens there once the probe is closed
    with caplog.at_level(logging.WARNING, "backends.openai.replica_health"):
        assert _serving(ReplicaHealth(f"http://127.0.0.1:{closed}/metrics")) == [None, None]
    assert len(caplog.records) == 1, caplog.records
    assert caplog.records[0].getMessage().startswith(f"cannot read Triton's metrics at http://127.0.0.1:{closed}/")
