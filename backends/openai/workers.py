"""The API's worker processes on one port (``--workers N``, N > 1), each with a listening socket of its own.

uvicorn's own workers share one listening socket, and the worker that wakes first accepts every connection waiting
(asyncio accepts up to its backlog per wake-up): on the H200 peer benchmark one of four workers held 83% of the
API's samples while 32 streams arrived at once (``bench/results/peer/text-c32-pyspy-2026-12-02/``). Here each worker
listens on a socket of its own with ``SO_REUSEPORT``, and Linux hashes each new connection to one of them (socket(7)),
so the streams spread over the workers.

The parent first takes the port's lock file (``fcntl.flock``; another API asking for the port, which ``SO_REUSEPORT``
would let in beside these workers, is refused), then binds the port with ``SO_REUSEPORT`` but never listens on it:
that checks the port (a socket without ``SO_REUSEPORT`` there refuses it) and reserves it (port 0: picks it), and no
connection goes to a socket that does not listen. It then watches the workers: SIGTERM or SIGINT stops them all (each
gives the requests in flight ``shutdown_grace_s`` seconds: uvicorn's graceful shutdown); a worker killed by a signal
(the OOM killer) or that ends later than ``STARTUP_S`` seconds after its start is started again; one that fails with
an error sooner (a broken configuration: it would fail again) stops the others, and the parent exits with status 1.
Each worker gets SIGTERM if the parent dies (``PR_SET_PDEATHSIG``), so a killed parent leaves no worker on the port.
"""
from __future__ import annotations

import ctypes
import fcntl
import logging
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import uvicorn

from backends.openai.config import ApiConfig, parse_args

log = logging.getLogger(__name__)
STARTUP_S = 10.0
BACKLOG = 2048  # uvicorn's default
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEPORT`` (and ``SO_REUSEADDR``), not listening. Raises
    OSError when the port is taken by a socket without ``SO_REUSEPORT`` or of another user."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def port_lock(port: int):
    """The open lock file of the API on ``port`` (kept open for the API's life; the lock goes with the process).
    Raises RuntimeError when another process holds it."""
    path = Path(tempfile.gettempdir()) / f"unifiedserve-openai-port-{port}.lock"
    lock = open(path, "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise RuntimeError(f"OpenAI API port {port} is taken by another UnifiedServe OpenAI API (it holds {path}): "
                           "choose another port") from None
    return lock


def _worker(args: list[str], parent: int) -> None:
    """One worker process: the app on a listening socket of its own (``args``: its ``ApiConfig.to_args``), ended
    with SIGTERM when ``parent`` dies."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
    if os.getppid() != parent:  # the parent died before the line above
        return
    config = parse_args(args)
    sock = reuse_port_socket(config.host, config.port)
    sock.listen(BACKLOG)
    uvicorn.Server(uvicorn.Config("backends.openai.__main__:app_from_env", factory=True,
                                  timeout_graceful_shutdown=config.shutdown_grace_s, backlog=BACKLOG)
                   ).run(sockets=[sock])


def _restart(exitcode: int, lived_s: float) -> bool:
    """Whether a worker that ended with ``exitcode`` (negative: killed by that signal) after ``lived_s`` seconds is
    started again."""
    return exitcode <= 0 or lived_s >= STARTUP_S


def serve(config: ApiConfig) -> int:
    """Run ``config.workers`` worker processes until SIGTERM or SIGINT; returns the exit status (0, or 1 when a worker
    failed at its start). The workers build their apps from ``CONFIG_ENV`` (``backends.openai.__main__``), which the
    caller sets. Raises RuntimeError when another UnifiedServe API holds the port, OSError when another program
    does."""
    lock = port_lock(config.port) if config.port else None
    reserved = reuse_port_socket(config.host, config.port)  # kept, never listening, until the workers have stopped
    port = reserved.getsockname()[1]
    lock = lock or port_lock(port)
    args = replace(config, port=port).to_args()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    spawn = multiprocessing.get_context("spawn")

    def start() -> tuple[multiprocessing.Process, float]:
        process = spawn.Process(target=_worker, args=(args, os.getpid()), name="openai-api-worker")
        process.start()
        return process, time.monotonic()

    workers, status = [start() for _ in range(config.workers)], 0
    host = f"[{config.host}]" if ":" in config.host else config.host
    print(f"INFO:     OpenAI API on http://{host}:{port}: {config.workers} worker processes "
          f"(pids {', '.join(str(p.pid) for p, _ in workers)}), a listening socket each", file=sys.stderr, flush=True)
    while not stop.wait(0.5):
        for k, (process, started) in enumerate(workers):
            if process.is_alive():
                continue
            if not _restart(process.exitcode, time.monotonic() - started):
                log.error("OpenAI API worker %d failed at its start (exit status %s): stopping", process.pid,
                          process.exitcode)
                status = 1
                stop.set()
                break
            log.warning("OpenAI API worker %d ended (exit status %s): starting another", process.pid,
                        process.exitcode)
            workers[k] = start()
    for process, _ in workers:
        if process.is_alive():
            process.terminate()  # SIGTERM: uvicorn's graceful shutdown
    for process, _ in workers:
        process.join()
    reserved.close()
    lock.close()
    return status
