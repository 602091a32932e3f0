"""A model whose process dies (kill -9, out of memory) while serving: Triton 2.51 keeps it READY and fails its
requests without restarting it, so the launcher stops the server (exit status 3) for a supervisor to restart."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest

from backends.triton.launcher import DIED_EXIT_TIMEOUT_S, STAGE_DIED, TritonServer
from backends.triton.ports import ServerPorts
from backends.triton.repository import repository_with
from backends.triton.stubs import watch_stages
from client.api import Client, ServerError

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("model", ["decode", "orchestrator"])
def test_a_dead_stage_is_noticed_named_and_its_clients_let_go_soon(tmp_path, model):
    """The launcher's path: watch, then a short stop. A request in flight ends with an error soon after (with the
    orchestrator gone, nothing could send its final response: Triton would wait out its exit timeout twice)."""
    server = TritonServer(ports=ServerPorts.unused(), log_path=tmp_path / "server.log").start()
    url = f"127.0.0.1:{server.ports.grpc}"
    sampling = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}
    outcome: list[BaseException | object] = []

    def in_flight() -> None:
        try:
            with Client(url) as client:
                outcome.append(client.generate("Go on.", sampling={**sampling, "max_tokens": 100000 // 8},
                                               timeout_s=120))
        except Exception as exc:
            outcome.append(exc)

    try:
        stubs = server.ready_stubs
        assert stubs == server.stubs()
        assert sorted(stubs.values()) == ["decode", "encode_prefill", "flashcodec", "orchestrator"]
        with Client(url) as client:
            assert client.generate("Hello", sampling=sampling).num_output_tokens == 2
        runner = threading.Thread(target=in_flight)
        runner.start()
        time.sleep(1.0)
        os.kill(next(pid for pid, name in stubs.items() if name == model), signal.SIGKILL)
        started = time.monotonic()
        assert watch_stages(server, period_s=0.2) == f"the process of model {model} has died"
        assert time.monotonic() - started < 5
        with Client(url) as client, pytest.raises(ServerError):
            client.generate("Hello", sampling=sampling, timeout_s=30)  # what the server does until it is stopped
        started = time.monotonic()
        server.stop(drain_timeout_s=2.0, exit_timeout_s=DIED_EXIT_TIMEOUT_S)
        runner.join(timeout=15)
        assert time.monotonic() - started < 15 and not runner.is_alive()
        assert outcome and isinstance(outcome[0], Exception), outcome
    finally:
        server.stop()
    assert STAGE_DIED == 3


def test_a_server_stopped_while_its_models_load_leaves_no_process():
    """Stubs still loading when tritonserver exits would outlive it (a user saw three keep running)."""
    server = TritonServer(ports=ServerPorts.unused())

    def start() -> None:
        with contextlib.suppress(RuntimeError):  # "exited" when the stop comes first; a start that wins is fine too
            server.start()

    starting = threading.Thread(target=start, daemon=True)
    starting.start()
    deadline = time.monotonic() + 60
    while not (server.process and server.stubs()) and time.monotonic() < deadline:
        time.sleep(0.1)  # until the first stage process is up
    assert server.stubs(), "no stage process started"
    server.stop()
    starting.join(timeout=60)
    deadline = time.monotonic() + 10  # killed stubs are zombies until init reaps them
    while time.monotonic() < deadline:
        try:
            os.killpg(server.process.pid, 0)
        except ProcessLookupError:
            return  # nothing left in the server's process group
        time.sleep(0.2)
    pytest.fail("processes of the stopped server are still running")


@pytest.mark.parametrize("model, key, value, reason", [
    ("orchestrator", "max_share", "2", r"max_share must be in \(0, 1\], got 2.0"),
    ("decode", "cuda_graphs", "maybe", "cuda_graphs must be auto, on or off, got 'maybe'"),
])
def test_a_model_that_cannot_load_is_named_with_its_reason(tmp_path, model, key, value, reason):
    """Values the launcher's --set check lets through (not integers) fail in the model's initialize: the start
    error names the model and the exception's message, not only Triton's "failed to load all models"; the stub
    that failed exits without a crash (its metrics are made once it has loaded)."""
    repository = repository_with(tmp_path / "repository", {model: {key: value}})
    server = TritonServer(repository, ports=ServerPorts.unused(), log_path=tmp_path / "server.log")
    with pytest.raises(RuntimeError, match=f"model {model} did not load: ValueError: .*{reason}"):
        server.start()
    assert "Segmentation fault" not in (tmp_path / "server.log").read_text()
