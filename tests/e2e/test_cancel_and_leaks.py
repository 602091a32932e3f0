"""Cancelled requests stop generating and return their pages (case C8; design.md, invariant 2)."""
from __future__ import annotations

import time

import pytest

from client.api import Client
from tests.e2e.conftest import read_metrics
from tests.media import make_video

pytestmark = pytest.mark.e2e
LONG = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0}


def wait_for_idle_pools(server, timeout_s: float = 60.0) -> dict[str, float]:
    """Poll the free-page gauges until they equal the totals; returns the last reading."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = read_metrics(server)
        idle = (m["unifiedserve_kv_pages_free"] == m["unifiedserve_kv_pages_total"]
                and m["unifiedserve_patch_pages_free"] == m["unifiedserve_patch_pages_total"]
                and m["unifiedserve_requests_running"] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def test_cancelled_stream_stops_and_returns_its_pages(server, grpc_url):
    video = make_video(None, 160, 112, 20, 10)
    with Client(grpc_url) as client:
        for _ in range(10):
            partial = client.generate("Describe.", video=video, sampling=LONG, cancel_after_responses=3)
            assert partial.finish_reason == "cancelled" and partial.num_responses >= 3
        m = wait_for_idle_pools(server)
        assert m["unifiedserve_kv_pages_free"] == m["unifiedserve_kv_pages_total"], m
        assert m["unifiedserve_patch_pages_free"] == m["unifiedserve_patch_pages_total"], m
        assert client.generate("Next one.", sampling={"max_tokens": 3}).num_output_tokens == 3


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
        assert client.generate("Next one.", sampling={"max_tokens": 2}).num_output_tokens == 2
