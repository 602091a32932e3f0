"""A model whose process dies (kill -9, out of memory) while serving: Triton 2.51 keeps it READY and fails its
requests without restarting it, so the launcher stops the server (exit status 3) for a supervisor to restart."""
from __future__ import annotations

import os
import signal
import time

import pytest

from backends.launcher import STAGE_DIED, ServerPorts, TritonServer, watch_stages
from client.api import Client, ServerError

pytestmark = pytest.mark.e2e


def test_a_dead_stage_is_noticed_and_named(tmp_path):
    server = TritonServer(ports=ServerPorts.unused(), log_path=tmp_path / "server.log").start()
    try:
        stubs = server.ready_stubs
        assert stubs == server.stubs() and sorted(stubs.values()) == ["decode", "encode_prefill", "flashcodec", "orchestrator"]
        sampling = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}
        with Client(f"127.0.0.1:{server.ports.grpc}") as client:
            assert client.generate("Hello", sampling=sampling).num_output_tokens == 2
        os.kill(next(pid for pid, model in stubs.items() if model == "decode"), signal.SIGKILL)
        started = time.monotonic()
        assert watch_stages(server, period_s=0.2) == "the process of model decode has died"
        assert time.monotonic() - started < 5
        with Client(f"127.0.0.1:{server.ports.grpc}") as client, pytest.raises(ServerError):
            client.generate("Hello", sampling=sampling, timeout_s=30)  # what the server does until it is stopped
    finally:
        server.stop()
    assert STAGE_DIED == 3
