"""Stopping a server with requests in flight: every model unloads promptly (no stream left open until the
exit timeout), nothing crashes, and each client gets an error or its final response, never a hang. The
`serve` helper stops the server and checks the stop's duration and the whole log (tests/e2e/conftest.py);
it does so for every server the e2e tests start, so an idle stop is covered there."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from backends.triton.stale_shm import SHM, lock_held, remove_stale_shared_memory
from client.api import Client, GenerationResult, ServerError
from tests.e2e.conftest import serve
from tests.media import make_video

pytestmark = pytest.mark.e2e
LONG = {"max_tokens": 20000, "ignore_eos": True, "temperature": 0}  # far more than fit before the stop


def test_stop_with_a_stream_and_a_video_in_flight(media_dir):
    video = make_video(None, 320, 240, 120, 30)
    outcomes: dict[str, object] = {}
    streaming = threading.Event()

    def ask(name: str, url: str, **kwargs) -> None:
        try:
            with Client(url) as client:
                outcomes[name] = client.generate("Tell me everything.", sampling=LONG, timeout_s=120, **kwargs)
        except (ServerError, TimeoutError) as exc:
            outcomes[name] = exc

    with serve(media_dir, idle_at_exit=False) as srv:  # on exit: stopped within the limit, clean log
        url = f"127.0.0.1:{srv.ports.grpc}"
        asks = [threading.Thread(target=ask, args=("text", url), kwargs={"on_text": lambda _: streaming.set()}),
                threading.Thread(target=ask, args=("video", url), kwargs={"video": video})]
        asks[0].start()
        assert streaming.wait(120), "the streaming request produced no token"
        asks[1].start()
        time.sleep(0.5)  # the video is being probed, decoded or encoded when the stop comes
    for thread in asks:
        thread.join(timeout=30)
        assert not thread.is_alive(), "a client still waits after the server stopped"
    for name, outcome in outcomes.items():
        finished = isinstance(outcome, GenerationResult) and outcome.finish_reason is not None
        assert finished or isinstance(outcome, ServerError), f"{name}: {outcome!r}"
    assert isinstance(outcomes["text"], ServerError), outcomes["text"]  # 20000 tokens cannot have finished


def launch():
    """``python -m backends.triton.launcher`` on free ports, started: (the process, its ports)."""
    import subprocess
    import sys

    from backends.triton.ports import ServerPorts

    ports = ServerPorts.unused()
    launcher = subprocess.Popen([sys.executable, "-m", "backends.triton.launcher", "--http-port", str(ports.http),
                                 "--grpc-port", str(ports.grpc), "--metrics-port", str(ports.metrics),
                                 "--openai-port", "0"],  # tests/e2e/test_openai_process.py starts the launcher's API
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return launcher, ports


def start_launcher():
    """:func:`launch`, read up to its ready line: (the process, its ports, that line); fails the test when the
    line is not the ready line."""
    launcher, ports = launch()
    ready = launcher.stdout.readline()
    assert "tritonserver ready" in ready, ready + launcher.stderr.read()
    return launcher, ports, ready


def test_sigterm_while_starting_leaves_no_server():
    """SIGTERM to the launcher before the models are ready stops the server it started (which runs in its
    own session, so nothing else would)."""
    import signal

    launcher, ports = launch()
    time.sleep(3)  # tritonserver is loading the models
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=90)
    assert launcher.returncode == 130, err
    left = _servers(ports)
    assert not left, f"tritonserver left running: pids {left}"


def test_a_second_ctrl_c_during_the_stop_leaves_no_server():
    """Two SIGINTs 50 ms apart (an impatient Ctrl-C, or a wrapper passing the signal on): the second is ignored, the
    stop runs to its end and nothing is left running (a new user's finding: tritonserver kept serving, orphaned)."""
    import signal

    launcher, ports, _ = start_launcher()
    launcher.send_signal(signal.SIGINT)
    time.sleep(0.05)
    launcher.send_signal(signal.SIGINT)
    _, err = launcher.communicate(timeout=90)
    assert launcher.returncode == 0, err
    assert "stopped before the server started" not in err, err
    left = _servers(ports)
    assert not left, f"tritonserver left running: pids {left}"


def test_a_sweep_beside_a_live_server_keeps_its_pools(media_dir):
    """Another launcher's start removes stale shared memory: a running server's pools (here after a request, so
    they exist) are kept, since its lock is held (backends.triton.stale_shm.remove_stale_shared_memory)."""
    with serve(media_dir) as srv:
        with Client(f"127.0.0.1:{srv.ports.grpc}") as client:
            client.generate("Hello", sampling={"max_tokens": 1})
        pools = sorted(SHM.glob(f"unifiedserve-{srv.run_dir.name}-*"))
        assert pools, "no pool files: the CPU pools live in /dev/shm"
        # what a launcher in another container (no tritonserver in its view) goes by
        assert lock_held(SHM / f"unifiedserve-{srv.run_dir.name}.lock")
        remove_stale_shared_memory()
        assert all(p.exists() for p in pools)
        with Client(f"127.0.0.1:{srv.ports.grpc}") as client:
            assert client.generate("Hello", sampling={"max_tokens": 1}).finish_reason in ("length", "stop")


def test_a_server_that_does_not_exit_is_killed_and_the_launcher_says_so():
    """tritonserver frozen (SIGSTOP) when the launcher is told to stop: after EXIT_TIMEOUT_S the launcher kills it,
    names what had not unloaded, exits 0 (the stop was asked for and nothing is left running: a user saw status
    247, Triton's -9, and no message) and leaves no process or shared memory behind."""
    import re
    import signal
    import tempfile

    from backends.triton.launcher import EXIT_TIMEOUT_S

    launcher, ports, ready = start_launcher()
    run = re.search(r"(unifiedserve-run-[a-z0-9_]+)\.log", ready)
    assert run, ready
    (server,) = _servers(ports)
    os.kill(server, signal.SIGSTOP)
    started = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=EXIT_TIMEOUT_S + 60)
    assert launcher.returncode == 0, err
    assert f"did not exit within {EXIT_TIMEOUT_S:g} s of its stop (model " in err and "killed" in err, err
    assert time.monotonic() - started < EXIT_TIMEOUT_S + 15, err
    assert not _servers(ports), "tritonserver left running"
    assert not sorted(SHM.glob(f"unifiedserve-{run.group(1)}[-.]*")), "its pools or lock outlived it"
    log = Path(tempfile.gettempdir()) / f"{run.group(1)}.log"
    text = log.read_text(errors="replace")
    assert "(most recent call first)" in text, "no stub stacks in the log"
    assert re.search(r"--- stacks of model (orchestrator|decode|encode_prefill|flashcodec) \(stub pid \d+\) ---", text)
    assert str(log) in err
    log.unlink()


def test_a_model_left_loaded_by_triton_is_named_when_triton_gives_up_its_stop():
    """Triton 2.51 keeps the orchestrator from unloading once a stream request that Triton itself refused (an input
    of the wrong type, never seen by the model) was cancelled with ``cancel_requests=True``: at the stop it waits
    out its own exit timeout and exits with status 1 (found by a user pass; the model's threads are idle). The
    launcher then names the model that had not unloaded and exits 0 (the stop was asked for, nothing is left
    running), rather than passing on Triton's 1 with no word."""
    import queue
    import re
    import signal

    import numpy as np
    import tritonclient.grpc as grpcclient

    from client.api import grpc_inputs, request_tensors

    launcher, ports, ready = start_launcher()
    log = re.search(r"log (\S+\.log)", ready)
    assert log, ready
    tensors = [(name, np.array([1], dtype=np.int32), "INT32") if name == "stream" else (name, value, kind)
               for name, value, kind in request_tensors("hi", sampling={"max_tokens": 4}, stream=True)]
    client, answers = grpcclient.InferenceServerClient(f"127.0.0.1:{ports.grpc}"), queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put(error))
    client.async_stream_infer("orchestrator", grpc_inputs(tensors), enable_empty_final_response=True)
    assert answers.get(timeout=30) is not None  # Triton's own refusal of the INT32 `stream`
    client.stop_stream(cancel_requests=True)
    client.close()
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=90)
    assert launcher.returncode == 0, err
    text = Path(log.group(1)).read_text(errors="replace")
    if "Exit timeout expired" in text:  # seen in every try here
        assert "gave up its stop after its exit timeout" in err and "model orchestrator had not unloaded" in err, err
        # the stubs' stacks went to the log before tritonserver gave up (launcher STACKS_AFTER_S)
        assert re.search(r"--- stacks of model orchestrator \(stub pid \d+\) ---", text), text[-3000:]


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSEGV"])
def test_a_tritonserver_that_dies_makes_the_launcher_exit_3_naming_why_and_leaves_no_shared_memory(sig):
    """tritonserver killed (the OOM killer's SIGKILL, a crash's SIGSEGV) while the launcher watches it: the launcher
    exits with status 3 within 5 s, says which signal and where the log is, and removes the server's pools, lock
    and Python-backend regions (whose names it noted while the server ran), also while another server could run."""
    import re
    import signal

    from backends.triton.stubs import stub_regions

    launcher, ports, ready = start_launcher()
    run = re.search(r"(unifiedserve-run-[a-z0-9_]+)\.log", ready)
    assert run, ready
    (server,) = _servers(ports)
    regions = stub_regions(server)
    assert regions and all((SHM / r).exists() for r in regions), regions
    assert list(SHM.glob(f"unifiedserve-{run.group(1)}[-.]*")), "no pool or lock file of the server"
    os.kill(server, getattr(signal, sig))
    started = time.monotonic()
    _, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 3, err
    assert time.monotonic() - started < 5, err
    assert f"tritonserver was killed by {sig}" in err and f"{run.group(1)}.log" in err, err
    left = [p.name for p in SHM.glob(f"unifiedserve-{run.group(1)}[-.]*")] + [r for r in regions if (SHM / r).exists()]
    assert not left, left


def test_a_tritonserver_stopped_from_elsewhere_is_no_crash():
    """SIGINT sent to tritonserver itself (not to the launcher): the server drains as the launcher would have (its
    stop is announced to the models), exits 0, and the launcher exits 0 without calling it a crash."""
    import signal

    launcher, ports, _ = start_launcher()
    (server,) = _servers(ports)
    os.kill(server, signal.SIGINT)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, err
    assert "killed by" not in err and "exited by itself" not in err, err


def _servers(ports) -> list[int]:
    """The pids of the tritonservers on ``ports.http`` (their command line names the port)."""
    flag = f"--http-port={ports.http}".encode()
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if flag in cmdline.read_bytes().split(b"\0"):
                found.append(int(cmdline.parent.name))
        except OSError:  # the process ended while we looked
            pass
    return found
