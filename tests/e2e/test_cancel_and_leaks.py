"""Cancelled requests stop generating and return their pages (case C8; docs/design.md, invariant 2); the server's
processes give freed upload buffers back to the system."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from backends.triton.server_binary import HEAP_ENV
from client.api import Client
from tests.e2e.conftest import wait_for_idle_pools
from tests.media import make_video

pytestmark = pytest.mark.e2e
LONG = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0}


def test_cancelled_stream_stops_and_returns_its_pages(server, grpc_url):
    video = make_video(None, 160, 112, 20, 10)
    with Client(grpc_url) as client:
        for _ in range(30):
            partial = client.generate("Describe.", video=video, sampling=LONG, cancel_after_responses=3)
            assert partial.finish_reason == "cancelled" and partial.num_responses >= 3
        m = wait_for_idle_pools(server)
        assert m["unifiedserve_kv_pages_free"] == m["unifiedserve_kv_pages_total"], m
        assert m["unifiedserve_patch_pages_free"] == m["unifiedserve_patch_pages_total"], m
        assert client.generate("Next one.", sampling={"max_tokens": 3, "ignore_eos": True}).num_output_tokens == 3


def test_cancel_while_media_is_still_decoding(server, grpc_url):
    """Cancelled before the first token: flashcodec is stopped and the patch pages come back."""
    video = make_video(None, 320, 240, 120, 30)
    with Client(grpc_url) as client:
        for _ in range(3):
            try:
                client.generate("Describe.", video=video, sampling=LONG, timeout_s=0.3)
            except TimeoutError:
                pass  # the client cancels the request when it times out
        m = wait_for_idle_pools(server)
        assert m["unifiedserve_patch_pages_free"] == m["unifiedserve_patch_pages_total"], m
        assert client.generate("Next one.", sampling={"max_tokens": 2, "ignore_eos": True}).num_output_tokens == 2


def test_http_client_going_away_mid_stream(server, http_url):
    """Case C8 over HTTP: the client closes the SSE connection after the first events. Triton 2.51's HTTP
    frontend does not turn a closed connection into a cancellation (gRPC does), so generation runs to
    max_tokens; the server must stay up and every page must come back."""
    import http.client
    import json

    host, port = http_url.split(":")
    for _ in range(5):
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        sampling = {**LONG, "max_tokens": 300}
        body = {"text_input": "Tell me everything.", "stream": True, "sampling_parameters": json.dumps(sampling)}
        conn.request("POST", "/v2/models/orchestrator/generate_stream", json.dumps(body),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        events = 0
        while events < 3:
            if response.readline().startswith(b"data:"):
                events += 1
        conn.close()
    m = wait_for_idle_pools(server, timeout_s=120)
    assert m["unifiedserve_kv_pages_free"] == m["unifiedserve_kv_pages_total"], m


def test_a_lone_cancelled_request_stops_generating(server, grpc_url):
    """Tokens arrive faster than the cancellation poll: the poll must still run (3000 tokens would take
    far longer than the bound below)."""
    import time

    with Client(grpc_url) as client:
        client.generate("Go on.", sampling={**LONG, "max_tokens": 3000}, cancel_after_responses=2)
    started = time.monotonic()
    m = wait_for_idle_pools(server, timeout_s=30)
    assert m["unifiedserve_num_requests_running"] == 0 and time.monotonic() - started < 10, m


def test_every_server_process_has_the_fixed_mmap_threshold(server):
    """tritonserver and every stub run with the launcher's HEAP_ENV (or the environment's own value), so buffers of
    4 MiB or more (uploads, decoded images) go back to the system when freed (bench/RESULTS.md, "memory after
    large payloads")."""
    name = "MALLOC_MMAP_THRESHOLD_"
    expected = os.environ.get(name, HEAP_ENV[name]).encode()
    for pid in [server.process.pid, *server.stubs()]:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert f"{name}=".encode() + expected in environ, (pid, server.stubs().get(pid, "tritonserver"))
