"""The OpenAI-compatible API as a process (backends/openai/process.py and the launcher's part): several workers on
one port, the in-flight limit, a server that stops, and the launcher that starts, stops and watches the API."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from backends.openai.api_keys import ENV as API_KEY_ENV
from backends.openai.config import ApiConfig
from backends.openai.process import REPO_ROOT, check_port_free
from backends.triton.ports import ServerPorts
from tests.e2e.conftest import serve
from tests.e2e.test_openai_api import EXTRA, MODEL, _api, _unused_port
from tests.processes import running

pytestmark = pytest.mark.e2e
STREAMS = 32  # held at once over --workers 2: all on one worker by chance has odds of 1 in 2 ** 31 (12: 1 in 2,048)


def _connections(pids: set[str], port: int) -> dict[str, int]:
    """Each of ``pids``' established TCP connections on local port ``port`` (/proc/net/tcp and the pids' fds)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 01: ESTABLISHED
                inodes.add(f"socket:[{fields[9]}]")
    counts = {}
    for pid in pids:
        links = []
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                links.append(os.readlink(fd))
            except OSError:  # closed meanwhile
                pass
        counts[pid] = sum(link in inodes for link in links)
    return counts


def test_several_workers_serve_one_port_and_stop_together(server, tmp_path):
    """--workers 2: two processes on the API's port, each with its own listening socket and connection to
    tritonserver; streams sent at once are all served, spread over both (uvicorn's shared socket gave one worker
    most of them), and a stop ends every process of the API."""
    with _api(server.ports.grpc, tmp_path / "api.log", workers=2) as process:
        with openai.OpenAI(base_url=f"{process.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
            def ask(k: int) -> str | None:
                return client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"Count {k}."}], max_tokens=4,
                    temperature=0).choices[0].finish_reason
            with ThreadPoolExecutor(8) as pool:
                assert set(pool.map(ask, range(16))) <= {"length", "stop"}
        time.sleep(0.5)  # its connections closed

        def started() -> set[str]:
            return set(re.findall(r"Started server process \[(\d+)\]", (tmp_path / "api.log").read_text()))
        # /health answered once one worker served: the other may still be loading the app (it listens before that)
        deadline = time.monotonic() + 60
        while len(started()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        workers = started()
        assert len(workers) == 2, (tmp_path / "api.log").read_text()[-3000:]

        opened, counted = threading.Barrier(STREAMS + 1), threading.Event()

        def hold() -> None:  # a stream on a connection of its own (kept alive after the stream) until counted
            with openai.OpenAI(base_url=f"{process.url}/v1", api_key="unused", max_retries=0, timeout=60) as own:
                stream = own.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Go on."}],
                                                     max_tokens=200, temperature=0, stream=True, extra_body=EXTRA)
                next(iter(stream))
                opened.wait()
                counted.wait(60)
                stream.close()
        with ThreadPoolExecutor(STREAMS) as pool:
            held = [pool.submit(hold) for _ in range(STREAMS)]
            opened.wait(60)
            per_worker = _connections(workers, process.config.port)
            counted.set()
            for future in held:
                future.result()
        # the kernel hashes each connection to a worker's socket: all STREAMS on one has odds of 2 in 2 ** STREAMS
        assert sum(per_worker.values()) >= STREAMS and min(per_worker.values()) > 0, per_worker
    for pid in workers:  # gone with the API
        assert not running(pid)


@pytest.mark.parametrize("workers", [1, 2])
def test_the_api_key_flag_of_the_api_started_alone_guards_every_worker(server, tmp_path, workers):
    """``python -m backends.openai --api-key KEY`` (not the launcher, which passes its keys by the environment):
    every worker answers 401 without the key or with another, 200 with it (before, the flag was dropped on the way
    to the workers and nothing was guarded). Each request on a new connection, so both workers are asked."""
    config = ApiConfig(grpc_url=f"127.0.0.1:{server.ports.grpc}", port=_unused_port(), workers=workers)
    env = {name: value for name, value in os.environ.items() if name != API_KEY_ENV}
    with open(tmp_path / "api.log", "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "backends.openai", *config.to_args(), "--api-key", "k1"],
                                   cwd=REPO_ROOT, env={**env, "PYTHONPATH": str(REPO_ROOT)}, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{config.port}"
    try:
        deadline = time.monotonic() + 60
        while not _answers(f"{url}/health"):
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "api.log").read_text()
            time.sleep(0.2)
        for _ in range(8):
            assert httpx.get(f"{url}/v1/models").status_code == 401
            assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer WRONG"}).status_code == 401
            assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 200
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_requests_over_the_limit_are_503(server, tmp_path):
    """An API with --max-requests 1: while one stream is in flight another request is answered 503 ("overloaded"),
    and once it ends the next one is served."""
    with _api(server.ports.grpc, tmp_path / "api.log", max_requests=1) as process, \
            openai.OpenAI(base_url=f"{process.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Go on."}],
                                                max_tokens=20000, temperature=0, stream=True, extra_body=EXTRA)
        next(iter(stream))
        with pytest.raises(openai.APIStatusError) as over:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert over.value.status_code == 503 and over.value.body["code"] == "overloaded", over.value.body
        assert "overloaded" in over.value.body["message"]
        with pytest.raises(openai.BadRequestError) as many:  # more prompts than it may run at once: 400, named
            client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=2)
        body = many.value.body
        assert body["param"] == "prompt" and body["message"].startswith("prompt: 2 prompts at once")
        stream.close()
        deadline = time.monotonic() + 30
        while True:  # the dropped stream's slot is freed once the API has seen the client go
            try:
                reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                       max_tokens=2)
                break
            except openai.APIStatusError as exc:
                assert exc.status_code == 503 and time.monotonic() < deadline, exc.body
                time.sleep(0.2)
        assert reply.choices[0].finish_reason in ("length", "stop")


def test_a_server_that_stops_is_503(media_dir, tmp_path):
    """A request in flight when tritonserver stops ends with the orchestrator's "shutting down" error (an error event
    in the stream, whose status was 200), and a request after the stop is answered 503."""
    outcome: dict[str, object] = {}
    streaming = threading.Event()
    with serve(media_dir, idle_at_exit=False) as srv:  # on exit: stopped promptly, with a clean log
        with _api(srv.ports.grpc, tmp_path / "api.log") as process, \
                openai.OpenAI(base_url=f"{process.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:

            def ask() -> None:
                try:
                    for _ in client.chat.completions.create(
                            model=MODEL, messages=[{"role": "user", "content": "Tell me everything."}],
                            max_tokens=20000, temperature=0, stream=True, extra_body=EXTRA):
                        streaming.set()
                    outcome["error"] = None
                except openai.APIError as exc:
                    outcome["error"] = exc

            asking = threading.Thread(target=ask)
            asking.start()
            assert streaming.wait(120), "the streaming request produced no token"
            srv.stop()
            asking.join(timeout=30)
            assert not asking.is_alive(), "the stream did not end when the server stopped"
            error = outcome["error"]
            assert isinstance(error, openai.APIError) and "shutting down" in error.message, repr(error)
            assert error.body["code"] == "service_unavailable", error.body
            with pytest.raises(openai.APIStatusError) as after:
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
            assert after.value.status_code == 503 and after.value.body["code"] == "service_unavailable"


def _launcher(*options: str) -> tuple[subprocess.Popen, int]:
    """``python -m backends.triton.launcher --openai-port P [options]`` on free ports, just started: it and P."""
    ports, api_port = ServerPorts.unused(), _unused_port()
    launcher = subprocess.Popen([sys.executable, "-m", "backends.triton.launcher", "--http-port", str(ports.http),
                                 "--grpc-port", str(ports.grpc), "--metrics-port", str(ports.metrics),
                                 "--openai-port", str(api_port), *options], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    return launcher, api_port


def _launch_with_api() -> tuple[subprocess.Popen, int]:
    """:func:`_launcher`, once it has said the server and the API are ready (its first two lines: checked)."""
    launcher, api_port = _launcher()
    ready, api_line = launcher.stdout.readline(), launcher.stdout.readline()
    if "tritonserver ready" not in ready or not api_line.startswith(
            f"OpenAI-compatible API: http://127.0.0.1:{api_port}/v1, log "):
        launcher.kill()
        pytest.fail(ready + api_line + launcher.stderr.read())
    return launcher, api_port


def test_the_launcher_serves_the_api_and_stops_it_first():
    """``python -m backends.triton.launcher --openai-port P``: the API's URL once the server is ready, a chat through
    it, and on SIGTERM both stop (exit status 0, nothing left listening on P). Of two streams in flight at the stop,
    the short one ends normally within the API's grace and the long one (20,000 tokens, far past it) with the "shutting
    down" error event, not a dropped connection."""
    launcher, api_port = _launch_with_api()
    outcomes: dict[int, object] = {}
    streaming = {n: threading.Event() for n in (60, 20000)}
    try:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{api_port}/v1", api_key="unused", max_retries=0,
                           timeout=120) as client:
            reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=2)
            assert reply.choices[0].finish_reason in ("length", "stop")

            def ask(max_tokens: int) -> None:
                try:
                    reason = None
                    for chunk in client.chat.completions.create(
                            model=MODEL, messages=[{"role": "user", "content": "Tell me everything."}],
                            max_tokens=max_tokens, temperature=0, stream=True, extra_body=EXTRA):
                        streaming[max_tokens].set()
                        reason = chunk.choices[0].finish_reason if chunk.choices else reason
                    outcomes[max_tokens] = reason
                except Exception as exc:  # the long one: openai.APIError; any other is the test's failure
                    outcomes[max_tokens] = exc

            # the long one first, then the short one once the long one streams: the short one's 60 tokens (a quarter
            # of a second on the CPU) need only outlast this thread's wake-up and the signal, not the long one's start
            asking = [threading.Thread(target=ask, args=(n,)) for n in (20000, 60)]
            for thread, n in zip(asking, (20000, 60)):
                thread.start()
                assert streaming[n].wait(120), f"the {n}-token streaming request produced no token"
            launcher.send_signal(signal.SIGTERM)
            assert 60 not in outcomes, "the short stream ended before the stop: it tests nothing"
            for thread in asking:
                thread.join(timeout=30)
            assert not any(thread.is_alive() for thread in asking), "a stream did not end when the launcher stopped"
        assert outcomes[60] == "length", repr(outcomes[60])
        error = outcomes[20000]
        assert isinstance(error, openai.APIError) and "shutting down" in error.message, repr(error)
        assert launcher.wait(timeout=60) == 0, launcher.stderr.read()
    finally:
        if launcher.poll() is None:
            launcher.kill()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", api_port), timeout=5).close()


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return out


def test_an_api_that_dies_makes_the_launcher_stop_the_server_and_exit_3():
    """The API process killed while serving: the launcher names it, stops tritonserver and exits 3 (for a supervisor
    to start both again) within seconds, as for a dead model process."""
    launcher, _ = _launch_with_api()
    try:
        (api_pid,) = [pid for pid in _children(launcher.pid)
                      if b"backends.openai" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        server_pids = [pid for pid in _children(launcher.pid) if pid != api_pid]
        os.kill(api_pid, signal.SIGKILL)
        started = time.monotonic()
        assert launcher.wait(timeout=30) == 3
        assert time.monotonic() - started < 15
        err = launcher.stderr.read()
        assert "the OpenAI API was killed by SIGKILL" in err and "exit status 3" in err, err
        assert err.strip().splitlines()[-1] == "tritonserver stopped (after the end above)", err  # not "a stage's"
        assert not [pid for pid in server_pids if Path(f"/proc/{pid}").exists()], "tritonserver left running"
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_a_server_that_dies_while_the_api_starts_is_reported_as_its_death_exit_3():
    """tritonserver killed right after its ready line, while the OpenAI API is still starting: the launcher names
    the server's death and exits 3 (for a supervisor), as once the API is up; it waited out the API's 60 s and
    exited 1 with "the OpenAI API not ready" before (a fresh user's find)."""
    launcher, _ = _launcher("--openai-workers", "2")
    try:
        assert "tritonserver ready" in launcher.stdout.readline()
        (server_pid,) = [pid for pid in _children(launcher.pid)
                         if b"tritonserver" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        os.kill(server_pid, signal.SIGKILL)
        started = time.monotonic()
        assert launcher.wait(timeout=60) == 3
        assert time.monotonic() - started < 20
        err = launcher.stderr.read()
        assert "tritonserver was killed by SIGKILL" in err and "exit status 3" in err, err
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_a_launcher_killed_takes_the_server_and_the_api_with_it():
    """SIGKILL to the launcher (an OOM kill): tritonserver and the API, in sessions of their own, get SIGTERM from the
    kernel (parent_death) and stop, leaving the API's port free for a supervisor's restart; both ran on for ever
    before, the API answering 503 on its port (a fresh user's find)."""
    launcher, api_port = _launch_with_api()
    children = _children(launcher.pid)
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 60
    while [pid for pid in children if running(pid)] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [pid for pid in children if running(pid)], "left running"
    check_port_free("127.0.0.1", api_port)  # free again, as a restarted launcher checks it

