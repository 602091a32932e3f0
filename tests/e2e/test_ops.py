"""Operability: a repository rendered from a deployment file served by `tritonserver` alone (no launcher, as the NGC
entrypoint or a Helm chart starts it), asked by the pip-installed client from another folder; and the launcher
serving a deployment file, with its progress lines while the models load."""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from PIL import ExifTags, Image

from backends.openai.replica_health import replicas_serving
from backends.triton import server_stop
from backends.triton.launcher import REPO_ROOT
from backends.triton.ports import ServerPorts
from backends.triton.server_binary import server_binary, server_command
from backends.triton.stale_shm import SHM
from backends.triton.standalone import server_run_name
from backends.triton.stubs import stub_processes
from client.api import Client, ServerError
from tests.e2e.conftest import assert_clean_log, read_metrics, repository_with
from tests.install import build_wheel, environment, install
from tests.media import gradient

pytestmark = pytest.mark.e2e
TINY_CPU = REPO_ROOT / "deploy" / "tiny_cpu.yaml"
GREEDY = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}


@contextlib.contextmanager
def stopped_alone(server: subprocess.Popen, log: Path, run_dir: Path):
    """Around the work with a server of :func:`start_alone`: then SIGINT (tritonserver alone), which it must obey
    within 60 s, exiting 0, leaving nothing behind; killed if the work failed."""
    try:
        yield
        server.send_signal(signal.SIGINT)
        assert server.wait(60) == 0, log.read_text()[-6000:]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    assert_nothing_left(server, run_dir)


def wait_ready(process: subprocess.Popen, ports: ServerPorts, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"tritonserver exited with {process.returncode}:\n{log.read_text()[-6000:]}"
        try:
            if urllib.request.urlopen(f"http://{ports.address}:{ports.http}/v2/health/ready", timeout=2).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"tritonserver not ready within {timeout_s} s:\n{log.read_text()[-6000:]}")


def start_alone(repository: Path, shm_bytes: int, cwd: Path, log: Path,
                extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, ServerPorts, Path]:
    """The pip binary as the launcher runs it, with ``extra`` flags, but with none of the launcher's environment
    (run directory, media folders, PYTHONPATH) and from ``cwd``: only what the binary itself needs (its libraries,
    the stub's python3). Returns the process, its ports and the run directory its models derive."""
    binary, backends, binary_env = server_binary()
    ports = ServerPorts.unused()
    argv = [*server_command(binary, backends, repository, ports, shm_bytes, 10), *extra]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("UNIFIEDSERVE_", "FLASHCODEC_")) and k != "PYTHONPATH"}
    with open(log, "wb") as out:
        server = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**env, **binary_env}, cwd=cwd,
                                  start_new_session=True)
    return server, ports, Path(tempfile.gettempdir()) / server_run_name(server.pid)


def assert_nothing_left(server: subprocess.Popen, run_dir: Path) -> None:
    assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())
    assert not sorted(SHM.glob(f"unifiedserve-{run_dir.name}[-.]*")), "its pools or lock outlived it"
    deadline = time.monotonic() + 10
    while stub_processes(server.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not stub_processes(server.pid), "model processes outlived the server"


def png(pixels: np.ndarray, orientation: int | None = None) -> bytes:
    exif = Image.Exif()
    if orientation is not None:
        exif[ExifTags.Base.Orientation] = orientation
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG", exif=exif.tobytes())
    return out.getvalue()


def test_plain_tritonserver_serves_a_rendered_repository_and_cleans_up(tmp_path):
    repository = tmp_path / "repository"
    rendered = subprocess.run([sys.executable, "-m", "backends.triton.launcher", "--config", str(TINY_CPU),
                               "--render", str(repository)], cwd=REPO_ROOT, capture_output=True, text=True)
    assert rendered.returncode == 0, rendered.stderr
    words = shlex.split(rendered.stdout)  # the environment the pip wheel's binary needs, then the command
    command = words[next(i for i, w in enumerate(words) if w.endswith("tritonserver")):]
    assert command[1] == f"--model-repository={repository}", rendered.stdout
    shm = next(w for w in command if w.startswith("--backend-config=python,shm-default-byte-size="))

    log, elsewhere = tmp_path / "server.log", tmp_path / "elsewhere"
    elsewhere.mkdir()
    site = install(build_wheel(tmp_path / "wheel"), tmp_path / "site")
    server, ports, run_dir = start_alone(repository, int(shm.rsplit("=", 1)[1]), elsewhere, log)
    try:
        wait_ready(server, ports, log)
        assert run_dir.is_dir()
        upright = gradient(0, 0.0, 140, 210)
        with Client(f"127.0.0.1:{ports.grpc}") as client:
            text = client.generate("Hello", sampling=GREEDY, return_output_ids=True)
            assert (text.finish_reason, len(text.token_ids)) == ("length", 4)
            assert (run_dir / "internal.token").stat().st_mode & 0o777 == 0o600  # the stage links' key
            # a photo on its side (EXIF orientation 6) counts the tokens of the upright one and is answered alike
            sideways = client.generate("What is it?", image=png(np.ascontiguousarray(np.rot90(upright)), 6),
                                       sampling=GREEDY, return_output_ids=True)
            straight = client.generate("What is it?", image=png(upright), sampling=GREEDY, return_output_ids=True)
            assert sideways.num_input_tokens == straight.num_input_tokens
            assert sideways.token_ids == straight.token_ids
            media = tmp_path / "clip.png"
            media.write_bytes(png(upright))
            with pytest.raises(ServerError, match="allowed"):  # media folders stay opt-in
                client.generate("Hi", image_url=str(media), sampling=GREEDY)
        # the console command of the pip-installed client, from a folder that is not the repository
        asked = subprocess.run([str(site / "bin" / "unifiedserve-client"), "--url", f"127.0.0.1:{ports.grpc}",
                                "--max-tokens", "3", "--temperature", "0", "Hi"], cwd=elsewhere,
                               env=environment(site), capture_output=True, text=True, timeout=120)
        assert asked.returncode == 0, asked.stderr
        assert "3 output tokens" in asked.stderr
        # the stop markers work in this run directory: the orchestrator drains and says so
        server_stop.announce(run_dir)
        assert server_stop.wait_drained(run_dir, 30), log.read_text()[-6000:]
        stubs = stub_processes(server.pid)
        assert sorted(stubs.values()) == ["decode", "encode_prefill", "flashcodec", "orchestrator"]
        server.send_signal(signal.SIGTERM)  # as `docker stop` does
        assert server.wait(60) == 0, log.read_text()[-6000:]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    assert_clean_log(log.read_text(errors="replace"))
    assert_nothing_left(server, run_dir)


def test_a_plain_tritonservers_stop_ends_the_requests_in_flight_with_the_shutdown_error(tmp_path):
    """A signal to tritonserver alone unloads every model at once: the stages let the orchestrator drain first
    (server_stop.drain_before_unload), so a running request ends with "the server is shutting down" (it ended with
    "decode: the stage closed its link" before: a fresh user's find) and the server exits by itself."""
    log = tmp_path / "server.log"
    server, ports, run_dir = start_alone(REPO_ROOT / "model_repository", 16 * 2**20, tmp_path, log)
    errors = []

    def ask() -> None:
        with Client(f"127.0.0.1:{ports.grpc}") as client:
            try:
                client.generate("Tell me a long story.", sampling={"max_tokens": 3000, "ignore_eos": True},
                                on_text=lambda _: started.set(), timeout_s=120)
            except ServerError as exc:
                errors.append(str(exc))

    with stopped_alone(server, log, run_dir):
        wait_ready(server, ports, log)
        started = threading.Event()
        asking = threading.Thread(target=ask)
        asking.start()
        assert started.wait(60), log.read_text()[-6000:]
        server.send_signal(signal.SIGINT)
        asking.join(60)
        assert errors == ["the server is shutting down"], errors


def test_a_stop_held_by_an_http_keep_alive_client_leaves_no_model_process_or_file(tmp_path):
    """Triton 2.51 waits out its exit timeout for HTTP connections before it unloads anything (an idle keep-alive
    connection is enough), then exits at once, its models still loaded (a fresh operator's find: orphan stubs at
    10-20% CPU, the pools left in /dev/shm). Each model then sees its parent gone (backends/triton/parent_watch.py):
    within seconds every model process has ended, and the server's run directory and pools are gone."""
    log = tmp_path / "server.log"
    server, ports, run_dir = start_alone(REPO_ROOT / "model_repository", 16 * 2**20, tmp_path, log)
    try:
        wait_ready(server, ports, log)
        started, errors = threading.Event(), []

        def ask() -> None:  # a stream in flight through the stop
            with Client(f"127.0.0.1:{ports.grpc}") as client:
                try:
                    client.generate("Tell me a long story.", sampling={"max_tokens": 30000, "ignore_eos": True},
                                    on_text=lambda _: started.set(), timeout_s=120)
                except Exception as exc:  # noqa: BLE001 - whatever ends it
                    errors.append(str(exc))

        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        assert started.wait(60), log.read_text()[-6000:]
        with httpx.Client() as keep_alive:  # one answered request, its connection kept open
            assert keep_alive.get(f"http://127.0.0.1:{ports.http}/v2/health/ready").status_code == 200
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(40)
            except subprocess.TimeoutExpired:  # its exit's own crash handler hung (seen once): a supervisor kills it
                server.kill()
                server.wait()
            deadline = time.monotonic() + 30
            while stub_processes(server.pid) and time.monotonic() < deadline:
                time.sleep(0.2)
        assert not stub_processes(server.pid), "model processes outlived their server"

        def left() -> list:
            return [*SHM.glob(f"unifiedserve-{run_dir.name}[-.]*"), *([run_dir] if run_dir.exists() else [])]
        while left() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left(), log.read_text()[-6000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)


def test_a_stage_unloaded_alone_by_model_control_has_the_refusals_name_it(tmp_path):
    """Triton's explicit model control unloading one stage ends the serving (the orchestrator does not take a stage
    back, also once it is loaded again): the stage's finalize names it, and the orchestrator's refusals say which
    model and what to do, where they said only that the server was shutting down while every model read READY (a
    fresh user's test, 2026-12-06); the replica's serving gauge reads 0 (2026-12-07). So it does after the
    orchestrator alone was unloaded and loaded again first, whose last finalize's drained mark made the stage's
    unload skip the announcement (2026-12-07: the refusals said "decode: the stage closed its link")."""
    log = tmp_path / "server.log"
    server, ports, run_dir = start_alone(REPO_ROOT / "model_repository", 16 * 2**20, tmp_path, log,
                                         ("--model-control-mode=explicit", "--load-model=*"))

    def reload(model: str) -> None:
        url = f"http://{ports.address}:{ports.http}/v2/repository/models/{model}"
        for action in ("unload", "load"):
            assert urllib.request.urlopen(urllib.request.Request(f"{url}/{action}", data=b"{}"), timeout=120).status \
                == 200
            if action == "unload":
                deadline = time.monotonic() + 60
                while model in stub_processes(server.pid).values() and time.monotonic() < deadline:
                    time.sleep(0.2)

    with stopped_alone(server, log, run_dir):
        wait_ready(server, ports, log)
        reload("orchestrator")
        with Client(f"127.0.0.1:{ports.grpc}") as client:
            assert client.generate("Hi", sampling=GREEDY, timeout_s=60).text  # serving again
        reload("decode")
        with Client(f"127.0.0.1:{ports.grpc}") as client:
            with pytest.raises(ServerError, match="its model decode was unloaded.*unload all its models and load"):
                client.generate("Hi", sampling=GREEDY, timeout_s=60)
        assert "serving stopped: its model decode was unloaded" in log.read_text(errors="replace")
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{ports.metrics}/metrics", timeout=10).read().decode()
        assert replicas_serving(metrics) is False  # the OpenAI API's /health reads 503 by it (it stayed 1)


def test_a_reload_with_a_new_configuration_is_refused_and_the_loaded_model_serves_on(tmp_path):
    """Triton's load of a loaded model with a new configuration starts the new instance beside the old one: two
    orchestrators hung requests and then aborted tritonserver (a fresh Triton user's test, 2026-12-07). The new one
    is refused, naming what to do, and the loaded one serves on (Triton's rule for a reload that fails). Triton 2.51
    then counts the refused load as a live model at its stop, which waits out ``--exit-timeout-secs`` and exits 1
    (any model's failed reload does: docs/deployment.md); nothing is left behind."""
    log = tmp_path / "server.log"
    server, ports, run_dir = start_alone(REPO_ROOT / "model_repository", 16 * 2**20, tmp_path, log,
                                         ("--model-control-mode=explicit", "--load-model=*"))
    try:
        wait_ready(server, ports, log)
        base = f"http://{ports.address}:{ports.http}/v2"
        config = json.loads(urllib.request.urlopen(f"{base}/models/orchestrator/config", timeout=30).read())
        config["parameters"]["max_media_items"] = {"string_value": "2"}
        body = json.dumps({"parameters": {"config": json.dumps(config)}}).encode()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(f"{base}/repository/models/orchestrator/load", data=body),
                                   timeout=120)
        assert "orchestrator: another instance of this model still runs in this server" in \
            refused.value.read().decode()
        with Client(f"127.0.0.1:{ports.grpc}") as client:
            assert client.generate("Hi", sampling=GREEDY, timeout_s=60).text
        assert "serving stopped" not in log.read_text(errors="replace")
        server.send_signal(signal.SIGINT)
        assert server.wait(60) in (0, 1), log.read_text()[-6000:]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    assert_nothing_left(server, run_dir)


@pytest.mark.parametrize("edited, reason, run_dir_made", [
    ({"decode": {"cuda_graphs": "maybe"}}, "cuda_graphs must be auto, on or off", True),
    # a hand edit the launcher never makes: every model refuses it before it makes anything
    ({"decode": {"seed": "7"}}, "must serve one model, but they set seed: ", False),
])
def test_plain_tritonserver_whose_model_cannot_load_leaves_nothing(tmp_path, edited, reason, run_dir_made):
    """Triton gives up the start when a model fails to load and unloads the others: the run directory goes with
    the last of them. The log names the reason: a bad value, or a repository whose models serve different models."""
    repository = repository_with(tmp_path / "repository", edited)
    log = tmp_path / "server.log"
    server, _, run_dir = start_alone(repository, 16 * 2**20, tmp_path, log)
    try:
        while not run_dir.is_dir() and server.poll() is None:  # made by the first model process to start
            time.sleep(0.05)
        assert run_dir.is_dir() or not run_dir_made, "the models made no run directory"
        assert server.wait(300) != 0, log.read_text()[-6000:]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    assert reason in log.read_text(errors="replace")
    assert_nothing_left(server, run_dir)


def test_the_launcher_serves_a_deployment_file_and_shows_the_models_loading():
    ports = ServerPorts.unused()
    launcher = subprocess.Popen([sys.executable, "-m", "backends.triton.launcher", "--config", str(TINY_CPU),
                                 "--http-port", str(ports.http), "--grpc-port", str(ports.grpc),
                                 "--metrics-port", str(ports.metrics)],
                                cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = launcher.stdout.readline()
        assert "tritonserver ready" in ready, ready + launcher.stderr.read()
        with Client(f"127.0.0.1:{ports.grpc}") as client:
            assert client.generate("Hello", sampling=GREEDY).finish_reason == "length"
        assert read_metrics(SimpleNamespace(ports=ports))["unifiedserve_kv_pages_total"] == 2048  # the file's pool, not the repository's
        config = json.load(urllib.request.urlopen(f"http://127.0.0.1:{ports.http}/v2/models/orchestrator/config"))
        parameters = {k: v["string_value"] for k, v in config["parameters"].items()}
        assert (parameters["slo_video_ttft_ms"], parameters["encode_budget"]) == ("20000", "10240")
    finally:
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=90)
    assert launcher.returncode == 0, err
    lines = err.splitlines()
    assert lines[-2:] == ["stopping: the models end the requests in flight and unload", "tritonserver stopped"], err
    log = re.fullmatch(r"tritonserver starting, log: (/\S+\.log)", lines[0])
    assert log, err  # the log's path comes first
    for model in ("orchestrator", "flashcodec", "encode_prefill", "decode"):
        loading, loaded = lines.index(f"{model}: loading"), next(
            n for n, line in enumerate(lines) if line.startswith(f"{model}: loaded in "))
        assert loading < loaded, err
    assert f"log {log[1]}" in ready
    Path(log[1]).unlink()
