"""The link between the orchestrator and the streaming stages (decode, flashcodec): calls and their streamed
replies over a Unix socket in the server's run directory, instead of decoupled BLS.

Why not BLS: in tritonserver 2.51's Python-backend stub, a decoupled BLS call made while another decoupled
call's response iterator is woken closes a cycle of three locks (the GIL, the stub's iterator map, one
iterator's own mutex) and wedges the orchestrator for good: every request hangs, no process dies
(gdb stacks in bench/results/cancel-wedge-cpu-2026-11-29). The orchestrator made one such call per admit,
abort and media item beside the long-lived decode stream, and the wedge came within a few rounds of
cancelled requests. One call per scheduler step to encode_prefill stays a plain (non-decoupled) BLS call,
which takes none of those locks.

Wire format: ``multiprocessing.connection`` (length-prefixed pickles; both ends prove they know the server's
internal token, ``backends.triton.internal_token``, before anything else is read). A call is ``(call_id, op, body)``;
each reply is ``(call_id, payload, final, error)``: zero or more payloads, then one final reply, which carries
the error message when the call failed. One connection per orchestrator. The orchestrator's end writes from
one thread, in call order (a video's bytes never hold up its event loop, nor let a later abort overtake the
decode it stops), and reads on another; the stage's end reads each connection on a thread of its own, which
also runs the handshake (a silent peer holds up only itself). A link whose reader ends, for whatever reason,
is closed, and every call on it fails at once.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import socket
import struct
import threading
import time
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any, AsyncIterator, Callable

from backends.triton.internal_token import internal_token
from backends.ipc.shared_tensor import run_dir

log = logging.getLogger(__name__)
MAX_SOCKET_PATH = 107  # bytes: sockaddr_un's sun_path, less its terminating NUL (Linux)
HANDSHAKE_TIMEOUT_S = 10.0


def address(name: str) -> str:
    """The socket of stage ``name`` (e.g. ``decode``, ``decode_1``, ``flashcodec``) in the run directory.
    Raises ValueError when the path is too long for a Unix socket (a long $TMPDIR)."""
    path = str(run_dir() / f"{name}.sock")
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise ValueError(f"stage link socket path {path!r} is longer than {MAX_SOCKET_PATH} bytes: set a shorter TMPDIR")
    return path


def _key() -> bytes:
    return internal_token().encode()


def _timeouts(conn_or_sock, seconds: float) -> None:
    """Kernel receive/send timeouts on the socket (0: none). Not ``settimeout``: that makes the descriptor
    non-blocking, which the Connection's plain reads and writes do not expect."""
    value = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
    with socket.socket(fileno=os.dup(conn_or_sock.fileno())) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def _handshake(sock: socket.socket, server: bool) -> Connection:
    """A Connection on ``sock``'s socket once both ends have proved the key, each step within
    HANDSHAKE_TIMEOUT_S s (``sock`` itself is left open). Raises OSError, EOFError or
    multiprocessing.AuthenticationError."""
    _timeouts(sock, HANDSHAKE_TIMEOUT_S)
    conn = Connection(os.dup(sock.fileno()))
    try:
        if server:
            deliver_challenge(conn, _key())
            answer_challenge(conn, _key())
        else:
            answer_challenge(conn, _key())
            deliver_challenge(conn, _key())
        _timeouts(conn, 0)
    except BaseException:
        conn.close()
        raise
    return conn


def _shut_down(conn: Connection) -> None:
    """Shut ``conn``'s socket down, which wakes a reader blocked in ``recv`` (closing it does not)."""
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except (OSError, ValueError):  # already shut, or closed
        pass


def _hang_up(conn: Connection, reader: threading.Thread | None) -> None:
    """Shut the socket down, join the reader, then close."""
    _shut_down(conn)
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
    ``end(error_message)`` once. Both are thread-safe and never raise; ``send`` returns False when the payload
    could not be delivered (the orchestrator has gone, or the call has ended), so that a stage can take back
    what the payload would have handed over (flashcodec: a group's patch pages)."""

    def __init__(self, conn: "_Served", call_id: int):
        self._conn, self._id, self._ended = conn, call_id, False

    def send(self, payload: Any) -> bool:
        return not self._ended and self._conn.reply((self._id, payload, False, None))

    def end(self, error: str | None = None) -> None:
        if not self._ended:
            self._ended = True
            self._conn.reply((self._id, None, True, error))


Handler = Callable[[str, Any, Call], None]  # (op, body, call): must not block; ends the call sooner or later


class _Served:
    """One orchestrator's connection to a stage: its thread runs the handshake, then hands each call to the
    handler."""

    def __init__(self, sock: socket.socket, handler: Handler, name: str):
        self.sock, self.handler, self.name = sock, handler, name
        self.conn: Connection | None = None
        self.lock = threading.Lock()  # replies come from several threads (decode's send thread, decoders)
        self.thread = threading.Thread(target=self._serve, name=f"link-{name}", daemon=True)
        self.thread.start()

    def reply(self, message: tuple) -> bool:
        """Send ``message``; False when the orchestrator has gone (closed or died)."""
        with self.lock:
            if self.conn is None:
                return False
            try:
                self.conn.send(message)
                return True
            except (OSError, ValueError):
                return False

    def _serve(self) -> None:
        try:
            conn = _handshake(self.sock, server=True)
        except Exception as exc:
            log.warning("%s: link connection refused: %r", self.name, exc)
            return
        finally:
            self.sock.close()
        with self.lock:
            self.conn = conn
        try:
            while True:
                call_id, op, body = conn.recv()
                call = Call(self, call_id)
                try:
                    self.handler(op, body, call)
                except Exception as exc:  # a bad call fails alone; the link and the stage go on
                    log.exception("%s: call %r failed", self.name, op)
                    call.end(f"{self.name}: {type(exc).__name__}: {exc}")
        except (EOFError, OSError):
            pass  # the orchestrator closed its end
        except Exception:
            log.exception("%s: the link's reader failed; closing the link", self.name)
        finally:
            with self.lock:
                self.conn = None
            _hang_up(conn, None)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # a handshake still waiting
        except OSError:
            pass
        with self.lock:
            conn = self.conn
        if conn is not None:
            _shut_down(conn)
        self.thread.join(timeout=5)


class LinkServer:
    """A stage's end: listens on ``address(name)`` and runs ``handler(op, body, call)`` on a thread per
    connection. Raises ValueError (socket path too long) or OSError (cannot listen)."""

    def __init__(self, name: str, handler: Handler):
        self.name, self.handler = name, handler
        self.address = address(name)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.address)
        self.listener.listen()
        self.served: list[_Served] = []
        self.lock = threading.Lock()
        self.closing = False
        self.thread = threading.Thread(target=self._accept, name=f"link-accept-{name}", daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:  # the listener was shut down
                return
            with self.lock:
                if self.closing:
                    sock.close()
                    return
                self.served = [s for s in self.served if s.thread.is_alive()]
                self.served.append(_Served(sock, self.handler, self.name))

    def close(self) -> None:
        """Stop accepting, close every connection and join the threads (no handler runs after this)."""
        with self.lock:
            self.closing = True
            served = list(self.served)
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        except OSError:
            pass
        self.thread.join(timeout=5)
        self.listener.close()
        try:
            os.unlink(self.address)
        except FileNotFoundError:
            pass
        for one in served:
            one.close()


class LinkClient:
    """The orchestrator's end of one stage's link, connected on first use (the stage may still be loading:
    waits up to ``connect_timeout_s`` seconds for its socket). Calls are written by one thread, in order;
    replies are read on another and handed to the event loop that made the call. Once the link is gone
    (the stage closed it or died), every open and later call fails with LinkError."""

    def __init__(self, name: str, connect_timeout_s: float = 120.0):
        self.name, self.connect_timeout_s = name, connect_timeout_s
        self.conn: Connection | None = None
        self.closed: str | None = None  # why the link is gone, once it is
        self.calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.ids = itertools.count()
        self.lock = threading.Lock()  # calls, closed
        self.connect_lock = threading.Lock()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()  # messages for the writer; None stops it
        self.reader: threading.Thread | None = None
        self.writer: threading.Thread | None = None

    def _connect(self) -> None:
        """Connect once (later callers wait for the first); raises LinkError naming why it could not."""
        with self.connect_lock:
            if self.conn is not None or self.closed:
                return
            path, deadline = address(self.name), time.monotonic() + self.connect_timeout_s
            while True:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.connect(path)
                    break
                except (FileNotFoundError, ConnectionRefusedError):  # not there yet, or not yet listening
                    sock.close()
                    if time.monotonic() > deadline:
                        raise LinkError(f"{self.name}: the stage's link {path} did not appear within "
                                        f"{self.connect_timeout_s:.0f} s (is the model loaded?)") from None
                    time.sleep(0.05)
                except OSError as exc:
                    sock.close()
                    raise LinkError(f"{self.name}: cannot connect to {path}: {exc}") from exc
            try:
                conn = _handshake(sock, server=False)
            except Exception as exc:
                raise LinkError(f"{self.name}: the link's handshake failed: {type(exc).__name__}: {exc}") from exc
            finally:
                sock.close()
            self.reader = threading.Thread(target=self._read, args=(conn,), name=f"link-{self.name}", daemon=True)
            self.writer = threading.Thread(target=self._write, args=(conn,), name=f"link-w-{self.name}",
                                           daemon=True)
            self.conn = conn
            self.reader.start()
            self.writer.start()

    def _write(self, conn: Connection) -> None:
        while (message := self.outbox.get()) is not None:
            try:
                conn.send(message)
            except Exception as exc:  # the stage has gone: the reader sees the end and fails every call
                log.warning("%s: could not send a call: %r", self.name, exc)
                self._fail(f"{self.name}: the link broke while sending: {exc}")

    def _read(self, conn: Connection) -> None:
        reason = f"{self.name}: the stage closed its link"
        try:
            while True:
                call_id, payload, final, error = conn.recv()
                with self.lock:
                    target = self.calls.pop(call_id, None) if final else self.calls.get(call_id)
                if target is not None:
                    loop, replies = target
                    loop.call_soon_threadsafe(replies.put_nowait, (payload, final, error))
        except (EOFError, OSError):
            pass
        except Exception as exc:  # a reply that will not unpickle, a loop that has closed
            log.exception("%s: the link's reader failed", self.name)
            reason = f"{self.name}: the link's reader failed: {type(exc).__name__}: {exc}"
        finally:
            self._fail(reason)

    def _fail(self, reason: str) -> None:
        """The link is gone: every open call fails with ``reason``, later ones at once."""
        with self.lock:
            self.closed = self.closed or reason
            calls, self.calls = self.calls, {}
        for loop, replies in calls.values():
            try:
                loop.call_soon_threadsafe(replies.put_nowait, (None, True, self.closed))
            except RuntimeError:  # the loop has closed: nobody waits
                pass

    def busy(self) -> bool:
        """Whether any call is waiting for its end."""
        with self.lock:
            return bool(self.calls)

    async def call(self, op: str, body: Any = None) -> AsyncIterator[Any]:
        """Yield the payloads of one call as they come; the call is sent by the writer thread, after every
        call made before it. Raises LinkError with the stage's message when the call fails or the link is
        gone (or cannot be made)."""
        if self.conn is None:
            await asyncio.to_thread(self._connect)
        replies: asyncio.Queue = asyncio.Queue()
        with self.lock:
            if self.closed:
                raise LinkError(self.closed)
            call_id = next(self.ids)
            self.calls[call_id] = (asyncio.get_running_loop(), replies)
            self.outbox.put((call_id, op, body))
        try:
            while True:
                payload, final, error = await replies.get()
                if error:
                    raise LinkError(error)
                if final:
                    return
                yield payload
        finally:  # also when the caller stops early (cancelled): later replies are dropped
            with self.lock:
                self.calls.pop(call_id, None)

    def close(self) -> None:
        """Close the connection and join its threads (open calls fail with "closed")."""
        self._fail(f"{self.name}: the link was closed")
        self.outbox.put(None)
        if self.writer is not None:
            self.writer.join(timeout=5)
        if self.conn is not None:
            _hang_up(self.conn, self.reader)
