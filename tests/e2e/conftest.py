"""One real tritonserver for the end-to-end tests (the repo's model_repository, CPU, dummy tiny model);
`serve` starts another one, e.g. on a repository with some model parameters changed
(`backends.triton.repository.repository_with`)."""
from __future__ import annotations

import contextlib
import os
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import pytest

from backends.triton.launcher import REPO_ROOT, TritonServer
from backends.triton.ports import ServerPorts
from backends.triton.repository import repository_with  # noqa: F401 (the tests' way to change parameters)
from backends.triton.stale_shm import SHM
from orchestrator.metrics import FLUSH_S

T = TypeVar("T")


@pytest.fixture(scope="session")
def media_dir(tmp_path_factory):
    """The folder the server accepts video_url / image_url paths from."""
    return tmp_path_factory.mktemp("media")


CRASH_NEEDLES = ("Traceback", "Stub process", "unhealthy", "Cannot remove future", "Segmentation fault",
                 "Non-graceful termination", "Exit timeout expired")
STOP_LIMIT_S = 15.0  # a clean stop takes a few seconds; the launcher kills the server 15 s after its SIGINT


@contextlib.contextmanager
def serve(media_dir: Path, model_repository: Path = REPO_ROOT / "model_repository",
          log_path: Path | None = None, idle_at_exit: bool = True,
          admin_header: tuple[str, str] | None = None) -> Iterator[TritonServer]:
    """A tritonserver on free ports. On exit (unless the body raised): with ``idle_at_exit``, checks that
    every KV and patch page is free again (no leaks); stops the server and checks that the stop was
    prompt and that the whole log, shutdown included, shows no crash (:func:`assert_clean_stop`)."""
    ports = ServerPorts.unused()
    srv = TritonServer(model_repository, ports=ports, extra_env={"UNIFIEDSERVE_MEDIA_DIRS": str(media_dir)},
                       log_path=log_path, admin_header=admin_header).start()
    try:
        yield srv
        if idle_at_exit:
            m = wait_for_idle_pools(srv)
            assert m["unifiedserve_kv_pages_free"] == m["unifiedserve_kv_pages_total"], m
            assert m["unifiedserve_patch_pages_free"] == m["unifiedserve_patch_pages_total"], m
            assert_clean_log(srv.log_tail(200_000))  # before the stop too, so a crash is not blamed on it
    except BaseException:
        srv.stop()
        raise
    assert_clean_stop(srv)


def assert_clean_log(log: str) -> None:
    for needle in CRASH_NEEDLES:
        assert needle not in log, f"the server log shows {needle!r}:\n{log[-20000:]}"


def assert_clean_stop(srv: TritonServer) -> float:
    """Stop ``srv``; assert that it exited by itself within STOP_LIMIT_S seconds, every model unloaded (no
    stub left holding a stream until the exit timeout) and nothing crashed. Returns the seconds taken."""
    started = time.monotonic()
    srv.stop()
    seconds = time.monotonic() - started
    log = srv.log_tail(200_000)
    assert_clean_log(log)
    assert srv.process.returncode == 0, f"tritonserver exited with {srv.process.returncode}:\n{log[-20000:]}"
    assert seconds < STOP_LIMIT_S, f"the server took {seconds:.1f} s to stop:\n{log[-20000:]}"
    left = sorted(p.name for p in SHM.glob(f"unifiedserve-{srv.run_dir.name}[-.]*"))
    assert not left, f"the server's pools or lock outlived it: {left}"
    return seconds


@pytest.fixture(scope="session")
def server(media_dir):
    # UNIFIEDSERVE_TEST_SERVER_LOG keeps the server log after the run (bench/device_run.sh sets it).
    log_path = os.environ.get("UNIFIEDSERVE_TEST_SERVER_LOG")
    with serve(media_dir, log_path=Path(log_path) if log_path else None) as srv:
        yield srv  # at the end of the suite: no leaks, no crash in the log


@contextlib.contextmanager
def openai_sdk(server: TritonServer, log_dir: Path):
    """The OpenAI API (``backends.openai``) in its own process beside ``server``, its log in ``log_dir``, and an
    ``openai`` SDK client of it (no retries)."""
    import openai

    from backends.openai.config import ApiConfig
    from backends.openai.process import ApiProcess

    config = ApiConfig(grpc_url=f"127.0.0.1:{server.ports.grpc}", port=ServerPorts.unused().http)
    with ApiProcess(config, log_dir / "api.log") as api:
        with openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            yield client


@pytest.fixture(scope="session")
def grpc_url(server):
    return f"127.0.0.1:{server.ports.grpc}"


@pytest.fixture(scope="session")
def http_url(server):
    return f"127.0.0.1:{server.ports.http}"


def read_metrics(server) -> dict[str, float]:
    """UnifiedServe's unlabelled gauges from the Prometheus endpoint."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.ports.metrics}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("unifiedserve_") and "{" not in line:
            name, value = line.split()
            values[name] = float(value)
    return values


def wait_for_idle_pools(server, timeout_s: float = 60.0) -> dict[str, float]:
    """Poll the free-page gauges until they equal the totals with no request running; returns the last reading."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = read_metrics(server)
        idle = (m["unifiedserve_kv_pages_free"] == m["unifiedserve_kv_pages_total"]
                and m["unifiedserve_patch_pages_free"] == m["unifiedserve_patch_pages_total"]
                and m["unifiedserve_num_requests_running"] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def assert_closing_cancels(server, stream) -> None:
    """Close ``stream`` (an SDK stream, its request running on ``server``) once the request is counted running:
    its request is cancelled, every page free again within 10 s (an HTTP client that goes away)."""
    deadline = time.monotonic() + 10  # gauges reach Triton within GAUGE_PERIOD_S (orchestrator/metrics.py)
    while read_metrics(server)["unifiedserve_num_requests_running"] < 1:
        assert time.monotonic() < deadline, "the streaming request is not counted as running"
        time.sleep(0.02)
    stream.close()
    started = time.monotonic()
    m = wait_for_idle_pools(server, timeout_s=30)
    assert m["unifiedserve_num_requests_running"] == 0
    assert m["unifiedserve_kv_pages_free"] == m["unifiedserve_kv_pages_total"]
    assert time.monotonic() - started < 10, "the dropped stream's request ran on"


def metrics_text(server) -> str:
    """The Prometheus endpoint's whole text."""
    return urllib.request.urlopen(f"http://127.0.0.1:{server.ports.metrics}/metrics", timeout=10).read().decode()


def settled(read: Callable[[], T], timeout_s: float = 30.0) -> T:
    """``read()`` once it has returned the same for a second longer than the orchestrator's period of sending counters
    and histograms (FLUSH_S; the slack is for a loaded machine): what earlier requests added has all arrived."""
    deadline = time.monotonic() + timeout_s
    last, since = read(), time.monotonic()
    while time.monotonic() - since <= FLUSH_S + 1.0:
        assert time.monotonic() < deadline, f"still changing after {timeout_s} s: {last}"
        time.sleep(0.2)
        value = read()
        if value != last:
            last, since = value, time.monotonic()
    return last
