"""The link between the orchestrator and the streaming stages (decode, flashcodec): calls and their streamed
replies over a Unix socket in the server's run directory, instead of decoupled BLS.

Why not BLS: in tritonserver 2.51's Python-backend stub, a decoupled BLS call made while another decoupled
call's response iterator is woken closes a cycle of three locks (the GIL, the stub's iterator map, one
iterator's own mutex) and wedges the orchestrator for good: every request hangs, no process dies
(gdb stacks in bench/results/cancel-wedge-cpu-2026-11-29). The orchestrator made one such call per admit,
abort and media item beside the long-lived decode stream, and the wedge came within a few rounds of
cancelled requests. One call per scheduler step to encode_prefill stays a plain (non-decoupled) BLS call,
which takes none of those locks.

Wire format: ``multiprocessing.connection`` (length-prefixed pickles; the client proves it knows the
server's internal token, ``backends.internal_token``, before anything is read). A call is
``(call_id, op, body)``; each reply is ``(call_id, payload, final, error)``: zero or more payloads, then one
final reply, which carries the error message when the call failed. One connection per orchestrator; one
reader thread on each side.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from backends.internal_token import internal_token
from backends.shared_tensor import run_dir

log = logging.getLogger(__name__)
MAX_SOCKET_PATH = 107  # bytes: sockaddr_un's sun_path, less its terminating NUL (Linux)


def address(name: str) -> str:
    """The socket of stage ``name`` (e.g. ``decode``, ``decode_1``, ``flashcodec``) in the run directory.
    Raises ValueError when the path is too long for a Unix socket (a long $TMPDIR)."""
    path = str(run_dir() / f"{name}.sock")
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise ValueError(f"stage link socket path {path!r} is longer than {MAX_SOCKET_PATH} bytes: set a shorter TMPDIR")
    return path


def _hang_up(conn: Connection, reader: threading.Thread | None) -> None:
    """Shut the socket down (which wakes a reader blocked in ``recv``, as closing it does not), join the
    reader, then close."""
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    if reader is not None and reader is not threading.current_thread():
        reader.join(timeout=5)
    conn.close()


class LinkError(RuntimeError):
    """A call failed in the stage (``message`` is the stage's), or the link is gone. ``invalid_input``: the
    stage blames the request (its message starts with "video" or "image")."""

    def __init__(self, message: str):
        super().__init__(message)
        self.invalid_input = message.startswith(("video", "image"))


class Call:
    """One call, as the stage's handler sees it: ``send(payload)`` any number of times, then ``end()`` or
    ``end(error_message)`` once. Both are thread-safe, never raise and do nothing once the orchestrator is
    gone or the call has ended."""

    def __init__(self, conn: "_Served", call_id: int):
        self._conn, self._id, self._ended = conn, call_id, False

    def send(self, payload: Any) -> None:
        if not self._ended:
            self._conn.reply((self._id, payload, False, None))

    def end(self, error: str | None = None) -> None:
        if not self._ended:
            self._ended = True
            self._conn.reply((self._id, None, True, error))


Handler = Callable[[str, Any, Call], None]  # (op, body, call): must not block; ends the call sooner or later


class _Served:
    """One orchestrator's connection to a stage: its reader thread hands each call to the handler."""

    def __init__(self, conn: Connection, handler: Handler, name: str):
        self.conn, self.handler, self.name = conn, handler, name
        self.lock = threading.Lock()  # replies come from several threads (decode's send thread, decoders)
        self.thread = threading.Thread(target=self._read, name=f"link-{name}", daemon=True)
        self.thread.start()

    def reply(self, message: tuple) -> None:
        try:
            with self.lock:
                self.conn.send(message)
        except (OSError, ValueError):  # the orchestrator has gone (closed or died): nobody to tell
            pass

    def _read(self) -> None:
        while True:
            try:
                call_id, op, body = self.conn.recv()
            except (EOFError, OSError, ValueError):
                return
            call = Call(self, call_id)
            try:
                self.handler(op, body, call)
            except Exception as exc:  # a bad call fails alone; the link and the stage go on
                log.exception("%s: call %r failed", self.name, op)
                call.end(f"{self.name}: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        _hang_up(self.conn, self.thread)


class LinkServer:
    """A stage's end: listens on ``address(name)`` and runs ``handler(op, body, call)`` on a reader thread
    per connection. Raises ValueError (socket path too long) or OSError (cannot listen)."""

    def __init__(self, name: str, handler: Handler):
        self.name, self.handler = name, handler
        self.address = address(name)
        self.listener = Listener(self.address, family="AF_UNIX", authkey=internal_token().encode())
        self.served: list[_Served] = []
        self.closing = False
        self.thread = threading.Thread(target=self._accept, name=f"link-accept-{name}", daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except Exception as exc:  # a client that failed the handshake, or the listener closed
                if self.closing:
                    return
                log.warning("%s: link connection refused: %r", self.name, exc)
                continue
            if self.closing:
                conn.close()
                return
            self.served.append(_Served(conn, self.handler, self.name))

    def close(self) -> None:
        """Stop accepting, close every connection and join the threads (no handler runs after this)."""
        self.closing = True
        try:  # wake the accept() (a closed listener does not)
            Client(self.address, family="AF_UNIX", authkey=internal_token().encode()).close()
        except OSError:
            pass
        self.thread.join(timeout=5)
        self.listener.close()
        for served in self.served:
            served.close()


class LinkClient:
    """The orchestrator's end of one stage's link, connected on first use (the stage may still be loading:
    waits up to ``connect_timeout_s`` seconds for its socket). Replies are read on a thread and handed to
    the event loop that made the call."""

    def __init__(self, name: str, connect_timeout_s: float = 120.0):
        self.name, self.connect_timeout_s = name, connect_timeout_s
        self.conn: Connection | None = None
        self.closed: str | None = None  # why the link is gone, once it is
        self.calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.ids = itertools.count()
        self.lock = threading.Lock()  # calls, conn, closed
        self.send_lock = threading.Lock()
        self.reader: threading.Thread | None = None

    def _connect(self) -> None:
        with self.lock:
            if self.conn is not None or self.closed:
                return
            path, deadline = address(self.name), time.monotonic() + self.connect_timeout_s
            while not Path(path).exists():
                if time.monotonic() > deadline:
                    raise LinkError(f"{self.name}: the stage's link {path} did not appear within "
                                    f"{self.connect_timeout_s:.0f} s (is the model loaded?)")
                time.sleep(0.05)
            self.conn = Client(path, family="AF_UNIX", authkey=internal_token().encode())
            self.reader = threading.Thread(target=self._read, name=f"link-{self.name}", daemon=True)
            self.reader.start()

    def _read(self) -> None:
        reason = f"{self.name}: the stage closed its link"
        while True:
            try:
                call_id, payload, final, error = self.conn.recv()
            except (EOFError, OSError, ValueError):
                break
            with self.lock:
                target = self.calls.pop(call_id, None) if final else self.calls.get(call_id)
            if target is not None:
                loop, queue = target
                loop.call_soon_threadsafe(queue.put_nowait, (payload, final, error))
        with self.lock:
            self.closed = self.closed or reason
            calls, self.calls = self.calls, {}
        for loop, queue in calls.values():  # every open call fails: no reply will come
            loop.call_soon_threadsafe(queue.put_nowait, (None, True, self.closed))

    def busy(self) -> bool:
        """Whether any call is waiting for its final reply."""
        with self.lock:
            return bool(self.calls)

    async def call(self, op: str, body: Any = None, large: bool = False) -> AsyncIterator[Any]:
        """Yield the payloads of one call as they come. ``large``: the body is sent from a worker thread
        (e.g. a video's bytes), not the event loop. Raises LinkError with the stage's message when the call
        fails or the link is gone."""
        if self.conn is None:
            await asyncio.to_thread(self._connect)
        queue: asyncio.Queue = asyncio.Queue()
        with self.lock:
            if self.closed:
                raise LinkError(self.closed)
            call_id = next(self.ids)
            self.calls[call_id] = (asyncio.get_running_loop(), queue)
        try:
            if large:
                await asyncio.to_thread(self._send, (call_id, op, body))
            else:
                self._send((call_id, op, body))
        except (OSError, ValueError) as exc:
            with self.lock:
                self.calls.pop(call_id, None)
            raise LinkError(f"{self.name}: could not send {op!r}: {exc}") from exc
        try:
            while True:
                payload, final, error = await queue.get()
                if error:
                    raise LinkError(error)
                if final:
                    return
                yield payload
        finally:  # also when the caller stops early (cancelled): later replies are dropped
            with self.lock:
                self.calls.pop(call_id, None)

    def _send(self, message: tuple) -> None:
        with self.send_lock:
            self.conn.send(message)

    def close(self) -> None:
        """Close the connection and join the reader (open calls fail with "closed")."""
        with self.lock:
            self.closed = self.closed or f"{self.name}: the link was closed"
            conn = self.conn
        if conn is not None:
            _hang_up(conn, self.reader)
