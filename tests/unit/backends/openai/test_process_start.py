"""The API process's start (backends/openai/process.py): waiting for its health, it gives up at once when the
inference server it fronts has exited (the launcher then reports the server's death, not the API's timeout)."""
import time

import pytest

from backends.openai.config import ApiConfig
from backends.openai.process import ApiProcess
from backends.triton.ports import ServerPorts


def test_the_start_gives_up_when_the_server_has_exited(tmp_path):
    # no inference server listens at grpc_url: /health stays 503, as while a crashed server's port is closed
    ports = ServerPorts.unused()
    api = ApiProcess(ApiConfig(grpc_url=f"127.0.0.1:{ports.grpc}", port=ports.http), tmp_path / "api.log")
    checks, started = [], time.monotonic()

    def gone() -> bool:
        checks.append(time.monotonic())
        return len(checks) > 3

    with pytest.raises(RuntimeError, match="the OpenAI API did not start: the inference server exited"):
        api.start(server_gone=gone)
    assert time.monotonic() - started < api.ready_timeout_s / 2 and api.process.poll() is not None
