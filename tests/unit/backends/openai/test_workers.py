"""The API's worker processes (backends/openai/workers.py): sockets that share a port, the port's lock against a
second API, which worker is started again, and a parent that stops when its workers fail at their start instead of
starting them again and again."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backends.openai.workers import STARTUP_S, _restart, port_lock, reuse_port_socket

REPO_ROOT = str(Path(__file__).resolve().parents[4])


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_sockets_with_reuse_port_share_a_port_and_others_are_refused():
    first = reuse_port_socket("127.0.0.1", 0)
    port = first.getsockname()[1]
    second = reuse_port_socket("127.0.0.1", port)  # a second worker's
    try:
        with socket.socket() as plain:
            with pytest.raises(OSError):
                plain.bind(("127.0.0.1", port))
    finally:
        first.close()
        second.close()


def test_a_port_taken_without_reuse_port_is_refused():
    with socket.socket() as plain:
        plain.bind(("127.0.0.1", 0))
        plain.listen()
        with pytest.raises(OSError):
            reuse_port_socket("127.0.0.1", plain.getsockname()[1])


def test_workers_that_fail_at_their_start_stop_the_parent():
    """A worker whose app cannot be built (here: no config in its environment) exits at once; the parent then stops
    the others and exits with status 1, within a few seconds (not a restart loop)."""
    code = ("import sys; from backends.openai.config import parse_args; from backends.openai.workers import serve; "
            f"sys.exit(serve(parse_args(['--port', '{_free_port()}', '--workers', '2'])))")
    env = {k: v for k, v in os.environ.items() if k != "UNIFIEDSERVE_OPENAI_ARGS"}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env={**env, "PYTHONPATH": REPO_ROOT},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "failed at its start (exit status 1): stopping" in done.stderr and time.monotonic() - started < 60


def test_a_second_api_on_the_port_is_refused_by_the_lock():
    port = _free_port()
    first = port_lock(port)
    try:
        with pytest.raises(RuntimeError, match=f"port {port} is taken by another UnifiedServe OpenAI API"):
            port_lock(port)
    finally:
        first.close()
    port_lock(port).close()  # free again once the first API's lock is gone


def test_a_killed_worker_is_started_again_and_one_that_fails_at_its_start_is_not():
    assert _restart(-9, 1.0)  # the OOM killer, right after a start
    assert _restart(0, 1.0)
    assert not _restart(1, 1.0) and not _restart(3, STARTUP_S / 2)  # an error at its start would come again
    assert _restart(1, STARTUP_S + 1)
