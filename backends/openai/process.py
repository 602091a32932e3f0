"""The API as a child process (``python -m backends.openai``): started once tritonserver is ready, stopped before
the server drains (the launcher, which tells the models of the stop near the end of the API's grace; the end-to-end
tests)."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from backends.openai.config import ApiConfig
from backends.triton.parent_death import ends_with_parent
from backends.triton.ports import check_bindable
from backends.triton.stubs import crashed

REPO_ROOT = Path(__file__).resolve().parents[2]
RELAY_S = 1.5  # seconds before the API's grace ends that its requests still in flight are failed (``ApiProcess.stop``)


def default_openai_workers() -> int:
    """API processes when none are asked for: one per 4 CPU cores, from 1 to 4. On the H200 peer benchmark
    (bench/RESULTS.md, "peer settings") 4 processes cut the 32-stream TBT mean from 8.36 to 6.20 ms against one."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def check_port_free(host: str, port: int) -> None:
    """Raises RuntimeError when another process listens on ``host:port`` (checked before a server starts, so that
    another API's answers do not pass for ours), or ``host`` is none of this machine's addresses
    (``ports.check_bindable``)."""
    check_bindable(host, port, "OpenAI API port", "--openai-address", "choose another with --openai-port (0: no API)")


@dataclass
class ApiProcess:
    """``python -m backends.openai`` with ``config``; its output goes to ``log_path`` (None: this process's)."""

    config: ApiConfig
    log_path: Path | None = None
    ready_timeout_s: float = 60.0
    process: subprocess.Popen | None = None
    ends_with_launcher: bool = False  # SIGTERM to it when this process dies (parent_death; the launcher's CLI)

    @property
    def url(self) -> str:
        """The API's base URL, e.g. http://127.0.0.1:9000 (a wildcard host is reached at 127.0.0.1)."""
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "") else self.config.host
        host = "[::1]" if host == "::" else f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.config.port}"

    def start(self, server_gone: Callable[[], bool] | None = None) -> "ApiProcess":
        """Start it and wait until ``/health`` answers 200. Raises RuntimeError (with its log's tail) when the port is
        taken, when it exits or is not ready within ``ready_timeout_s`` seconds, or when ``server_gone()`` (the
        server it fronts has exited) turns true meanwhile; it is stopped then."""
        check_port_free(self.config.host, self.config.port)
        log = open(self.log_path, "wb") if self.log_path is not None else None
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "backends.openai", *self.config.to_args()], cwd=REPO_ROOT,
                env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **self.config.env()}, stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches the launcher alone, which stops this in its turn
                preexec_fn=ends_with_parent() if self.ends_with_launcher else None)
        finally:
            if log is not None:
                log.close()
        deadline = time.monotonic() + self.ready_timeout_s
        while not self._healthy():
            gone = server_gone is not None and server_gone()
            if self.process.poll() is not None or time.monotonic() > deadline or gone:
                what = (f"exited with status {self.process.returncode}" if self.process.poll() is not None
                        else "did not start: the inference server exited" if gone
                        else f"not ready within {self.ready_timeout_s:g} s")
                self.stop()
                raise RuntimeError(f"the OpenAI API {what}{self._log_tail()}")
            time.sleep(0.2)
        return self

    def _healthy(self) -> bool:
        try:
            return urllib.request.urlopen(f"{self.url}/health", timeout=2).status == 200
        except OSError:  # refused, or an HTTP error status (urllib's HTTPError is an OSError)
            return False

    def _log_tail(self) -> str:
        if self.log_path is None:
            return ""
        try:
            return f"; the end of its log ({self.log_path}):\n{self.log_path.read_text(errors='replace')[-3000:]}"
        except OSError:
            return ""

    def exit_reason(self) -> str | None:
        """Why the API has ended by itself (a signal, an exit status; any exit is unasked while it serves), or None
        while it runs or before :meth:`start`."""
        if self.process is None or self.process.poll() is None:
            return None
        why = crashed(self.process.returncode, "the OpenAI API") or "the OpenAI API exited by itself"
        return why if self.log_path is None else f"{why} (its log: {self.log_path})"

    def stop(self, before_grace_ends: Callable[[], None] | None = None) -> None:
        """SIGTERM (the API takes no new connection and gives requests in flight ``shutdown_grace_s`` seconds, then
        stops its workers), SIGKILL to its whole session 5 s after that, or at once to what is left of it when the
        API's first process has already ended (its workers, if it was killed).

        ``before_grace_ends()`` is called :data:`RELAY_S` seconds before the grace ends (at once for a shorter
        grace) if the API has not exited by then, i.e. requests are still in flight: the launcher tells the models
        then, so that those requests end with the server's "shutting down" error, which the API relays within the
        grace, instead of a closed connection."""
        if self.process is None or self.process.poll() == 0:  # not started, or ended cleanly (its workers too)
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            grace = self.config.shutdown_grace_s
            try:
                if before_grace_ends is not None:
                    try:
                        self.process.wait(timeout=max(0.0, grace - RELAY_S))
                        return
                    except subprocess.TimeoutExpired:
                        before_grace_ends()
                self.process.wait(timeout=grace + 5)
                return
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # its session: the workers too
        self.process.wait()

    def __enter__(self) -> "ApiProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
