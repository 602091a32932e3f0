"""Helper processes: a fresh ``python3 -m MODULE`` started by this process, the socket pair between them, the
handshake, and the watch that notices a helper die (or miss its deadline) so that its owner can fail what waited on
it. Used by FlashCodec's GOP decoder workers (``flashcodec.gop_pool``), its NVDEC helpers
(``flashcodec.nvdec_remote``) and the vision tensor-parallel ranks (``backends.runtime.vision.tensor_parallel``).
Imports nothing heavy (no torch, no PyAV).

Why fresh interpreters started with ``subprocess``, not ``multiprocessing.Process``: inside Triton's Python-backend
stub ``sys.executable`` is the stub binary (hence `python_executable`), 'spawn' would also re-run the host's
``__main__`` in every helper, and 'fork' would copy the stub's threads and CUDA state. The parent's ``sys.path``
goes to the helper as PYTHONPATH, so that it imports the same packages.

Protocol. The helper runs ``python3 -m MODULE FD ARGS...``, FD being its end of a connected Unix socket pair (the
parent keeps no copy of it, so the end of the stream is seen as soon as either side has gone). Messages are pickled
over it (``multiprocessing.connection.Connection``); raw bytes may follow a message on the same socket
(`ParentLink.send_raw`, `HelperProcess.recv_raw_into`), which spares large arrays the copies of pickling. The
helper's first message is the handshake: ``READY`` (its Python version: pickles must match the parent's) or
``("failed", why)``. None from the parent asks a helper to end; the end of the stream ends it too.

Parent side: `HelperProcess` (with `handshake_all`, `close_all`); helper side: `ParentLink`.
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable, Sequence, TypeVar

log = logging.getLogger(__name__)
READY = ("ready", tuple(sys.version_info[:2]))  # a helper's handshake
WATCH_SLICE_S = 0.5  # the watch looks at the deadline at least this often (seconds): it may be moved at any time
REAP_S = 5.0  # a helper that closed its end is given this long to exit before it is killed (seconds)
JOIN_S = 10.0  # `close` waits this long for the watch thread (seconds); past it, that thread closes the socket
T = TypeVar("T")


class NoInterpreter(RuntimeError):
    """No usable python3 was found."""


class HelperStartError(RuntimeError):
    """A helper process did not start: no interpreter, no process, or no ready handshake in time."""


def python_executable() -> str:
    """The interpreter for helper processes: ``sys.executable`` when it is a python, else ``python3`` in the running
    interpreter's prefix (a venv's, then the base one), else ``python3`` on PATH. Raises NoInterpreter."""
    candidates = [sys.executable] if os.path.basename(sys.executable or "").startswith("python") else []
    candidates += [os.path.join(prefix, "bin", "python3") for prefix in (sys.prefix, sys.base_prefix)]
    candidates.append(shutil.which("python3") or "")
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise NoInterpreter("no python3 interpreter found for the helper processes")


@dataclass(frozen=True)
class Exit:
    """How a watched helper ended: its exit code (negative: the signal that killed it), whether it was killed
    because its deadline passed, and ``error``, when it was killed for another reason (no handshake, a message that
    did not unpickle, a callback that raised)."""

    code: int | None
    timed_out: bool = False
    error: str = ""

    def __str__(self) -> str:
        if self.timed_out:
            return "timed out"
        return f"exited (code {self.code})" + (f": {self.error}" if self.error else "")


class HelperProcess:
    """Parent side of one helper: ``python3 -m module FD *args`` started at once, and its socket pair.

    ``what`` names it in errors and logs (default: the module). ``socket_buffer``: send and receive buffer of both
    ends (bytes; 0: the system's), larger for fewer wake-ups per frame of several MB. Use: `handshake`, then
    `watch` (or ``watch(handshake_s=...)``: the handshake on the watch thread); `send` once it has shaken hands;
    `close` at the end. ``deadline`` (``time.monotonic()`` seconds, default infinity) may be set at any time: once
    it passes, the watch kills the helper. Raises HelperStartError when no interpreter is found or the process
    cannot be started.
    """

    def __init__(self, module: str, args: Sequence[Any] = (), *, what: str = "", socket_buffer: int = 0):
        self.module, self.args = module, tuple(str(a) for a in args)
        self.what = what or f"helper process {module}"
        self.deadline = math.inf
        self.exit: Exit | None = None  # set by the watch once the helper has gone
        self._send_lock = threading.Lock()
        self._watcher: threading.Thread | None = None
        parent, child = socket.socketpair()
        try:
            for end in (parent, child) if socket_buffer else ():
                end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, socket_buffer)
                end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, socket_buffer)
            self.python = python_executable()
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
            self.process = subprocess.Popen([self.python, "-m", module, str(child.fileno()), *self.args],
                                            pass_fds=[child.fileno()], env=env, stdin=subprocess.DEVNULL)
        except Exception as exc:  # no interpreter, no process
            parent.close()
            raise HelperStartError(f"{self.what} did not start: {type(exc).__name__}: {exc}") from exc
        finally:
            child.close()  # the helper's end only there: a helper that dies is seen at once, not at a timeout
        self.raw = parent  # for raw bytes
        self.conn = Connection(os.dup(parent.fileno()))  # for messages, on the same socket
        self.pid = self.process.pid

    @property
    def alive(self) -> bool:
        """Running, and (when watched) its stream not ended."""
        return self.exit is None and self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        """The exit code once it has exited (negative: the signal that killed it), else None."""
        return self.process.poll()

    def handshake(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` seconds for the helper's first message. Raises HelperStartError, saying
        "<what> did not start: <answer>", unless it is ``READY``; the answer is shown as received (e.g.
        ``('failed', 'RuntimeError: ...')``), None when none came in time or the helper exited first."""
        try:
            answer = self.conn.recv() if self.conn.poll(max(0.0, timeout_s)) else None
        except (EOFError, OSError):
            answer = None
        except Exception as exc:  # an answer that does not unpickle
            answer = f"{type(exc).__name__}: {exc}"
        if answer != READY:
            raise HelperStartError(f"{self.what} did not start: {answer!r}")

    def send(self, message: Any) -> None:
        """Pickle ``message`` to the helper (any thread). Raises OSError once the helper has gone."""
        with self._send_lock:
            self.conn.send(message)

    def recv_raw_into(self, view: memoryview) -> None:
        """Fill ``view`` with the raw bytes that follow a message (call from the watch's ``on_message``). Raises
        EOFError when the helper closes its end first."""
        while view:
            received = self.raw.recv_into(view)
            if not received:
                raise EOFError(f"{self.what} closed its socket mid-message")
            view = view[received:]

    def watch(self, on_message: Callable[[Any], None], on_exit: Callable[[Exit], None], *,
              handshake_s: float | None = None, on_ready: Callable[[], None] | None = None, name: str = "") -> None:
        """Start the thread (named ``name``) that reads the helper's messages: its handshake first when
        ``handshake_s`` is given (then ``on_ready()``), then ``on_message(message)`` for each message, in order. It
        kills the helper when ``deadline`` passes, when the handshake fails, when a message does not unpickle or
        ``on_message`` raises (logged). Once the helper has gone (exited, killed, its end closed) and been reaped,
        ``exit`` is set and ``on_exit(exit)`` called, exactly once; then the socket is closed. The callbacks run on
        that thread (``on_message`` may call `recv_raw_into`)."""
        self._watcher = threading.Thread(target=self._watch, args=(on_message, on_exit, handshake_s, on_ready),
                                         name=name or f"helper-{self.pid}", daemon=True)
        self._watcher.start()

    def _watch(self, on_message, on_exit, handshake_s, on_ready) -> None:
        timed_out, error = False, ""
        try:
            if handshake_s is not None:
                self.handshake(handshake_s)
                if on_ready is not None:
                    on_ready()
            while True:
                remaining = self.deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    break
                if self.conn.poll(min(remaining, WATCH_SLICE_S)):
                    on_message(self.conn.recv())  # no reference kept: the helper may free what it sent
        except (EOFError, OSError):
            pass  # the helper has gone
        except HelperStartError as exc:
            error = str(exc)
        except Exception as exc:  # a message that does not unpickle, a bug in a callback
            log.exception("%s (pid %d): stopping it", self.what, self.pid)
            error = f"{type(exc).__name__}: {exc}"
        self._reap(kill=timed_out or bool(error))
        self.exit = Exit(self.process.returncode, timed_out, error)
        try:
            on_exit(self.exit)
        except Exception:
            log.exception("%s (pid %d): handling its exit", self.what, self.pid)
        finally:
            self._close_socket()

    def _reap(self, kill: bool) -> None:
        if kill and self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(REAP_S)
        except subprocess.TimeoutExpired:
            self.process.kill()  # it closed its end but goes on
            self.process.wait()

    def kill(self) -> None:
        """SIGKILL, if it is still running (a watch then sees it go)."""
        if self.process.poll() is None:
            self.process.kill()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Whether the helper exited within ``timeout_s`` seconds (None: wait for it)."""
        try:
            self.process.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def close(self, timeout_s: float = 0.0) -> None:
        """`close_all` of this helper alone."""
        close_all([self], timeout_s)

    def _close_socket(self) -> None:
        self.conn.close()
        self.raw.close()


def handshake_all(helpers: Sequence[HelperProcess], timeout_s: float) -> None:
    """`HelperProcess.handshake` of each, within ``timeout_s`` seconds in all (they start side by side). Raises
    HelperStartError for the first that does not start."""
    deadline = time.monotonic() + timeout_s
    for helper in helpers:
        helper.handshake(deadline - time.monotonic())


def close_all(helpers: Sequence[HelperProcess], timeout_s: float = 0.0) -> None:
    """Stop ``helpers``: each is sent None (with ``timeout_s`` > 0) and given up to ``timeout_s`` seconds in all to
    exit, then killed; each watch thread is waited for (up to JOIN_S s: its ``on_exit`` has then run, unless
    called from that thread) and the sockets closed. Idempotent."""
    if timeout_s > 0:
        for helper in helpers:
            try:
                helper.send(None)
            except OSError:
                pass  # gone already
    deadline = time.monotonic() + timeout_s
    for helper in helpers:
        if not helper.wait(max(0.0, deadline - time.monotonic())):
            helper.kill()
            helper.wait()
    for helper in helpers:
        watcher = helper._watcher
        if watcher is None:
            helper._close_socket()
        elif watcher is not threading.current_thread():
            watcher.join(JOIN_S)  # it closes the socket when it ends: never close it under the thread


class ParentLink:
    """The helper's end, from the FD of its command line. Ignores SIGINT from here on (a Ctrl-C reaches the whole
    process group: the parent handles it and stops its helpers). The handshake comes first: `start` (or `ready`, or
    `failed` when the helper cannot work); `send` may be called from any thread."""

    def __init__(self, fd: int):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.conn = Connection(fd)
        self.raw = socket.socket(fileno=os.dup(fd))
        self._lock = threading.Lock()

    def start(self, build: Callable[[], T]) -> T:
        """The handshake around what the helper needs before it can work: ``build()``'s result, once `ready` has
        been sent; when ``build`` raises, `failed` with its error, which is raised again."""
        try:
            built = build()
        except Exception as exc:
            self.failed(f"{type(exc).__name__}: {exc}")
            raise
        self.ready()
        return built

    def ready(self) -> None:
        """The handshake: this helper works."""
        self.send(READY)

    def failed(self, why: str) -> None:
        """The handshake: this helper cannot work, because of ``why`` (the parent's HelperStartError shows it)."""
        self.send(("failed", why))

    def send(self, message: Any) -> None:
        """Pickle ``message`` to the parent. Raises OSError when the parent has gone."""
        with self._lock:
            self.conn.send(message)

    def send_raw(self, data) -> None:
        """Raw bytes (any buffer: a contiguous array) after a message, from the thread that sent that message."""
        self.raw.sendall(data)

    def receive(self) -> Any:
        """The parent's next message; None when it asked this helper to end, or its end has closed."""
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            return None  # the parent is gone

    def exit_with_parent(self) -> None:
        """For a helper that never reads its link: a thread ends this process (exit code 1) once the parent's end
        closes (it died, or closed this helper), so a helper whose parent was killed frees its memory and GPU.
        Messages are ignored."""

        def watch() -> None:
            while True:
                try:
                    self.conn.recv()
                except (EOFError, OSError):  # the end of the stream
                    os._exit(1)
                except Exception:  # a message that does not unpickle: ignored like the others
                    pass

        threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
