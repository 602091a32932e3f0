"""The stage link: the one transport of every call from the orchestrator to a stage (encode_prefill, decode,
flashcodec): a Unix socket per stage in the server's run directory, carrying the typed messages of
``backends.ipc.protocol``. docs/design.md ("Stage calls") says why this and not BLS.

Wire format: ``multiprocessing.connection`` (length-prefixed pickles; both ends prove they know the server's
internal token, ``backends.triton.internal_token``, before anything else is read). A call is ``(call_id,
message)`` with ``message`` a ``protocol.Call``; each reply is ``(call_id, payload, final, failure)``: zero or
more payloads, then one final reply, which carries a ``protocol.StageFailure`` when the call failed. One
connection per orchestrator. The orchestrator's end writes from one thread, in call order (a video's bytes
never hold up its event loop, nor let a later abort overtake the decode it stops), and reads on another; the
stage's end reads each connection on a thread of its own, which also runs the handshake (a silent peer holds
up only itself). A link whose reader ends, for whatever reason, is closed, and every call on it fails at once.
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

from backends.ipc.protocol import INVALID_INPUT, SERVER_FAULT, Call, StageFailure
from backends.ipc.run_dir import appeared, run_dir
from backends.triton.internal_token import internal_token

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


class StageError(RuntimeError):
    """A stage-link call failed: ``failure`` says how (``protocol.StageFailure``: the stage's message, and
    whether it blames the request); a link that is gone or cannot be made is a ``server_fault``."""

    def __init__(self, failure: StageFailure):
        super().__init__(failure.message)
        self.failure = failure

    @property
    def invalid_input(self) -> bool:
        return self.failure.kind == INVALID_INPUT


def _fault(message: str) -> StageError:
    return StageError(StageFailure(SERVER_FAULT, message))


class Reply:
    """One call, as the stage's handler answers it: ``send(payload)`` any number of times, then ``end()``,
    ``end(failure)`` or ``end(last=payload)`` (the last payload and the end in one message) once. Both are
    thread-safe and never raise; ``send`` returns False when the payload could not be delivered (the orchestrator
    has gone, or the call has ended), so that a stage can take back what the payload would have handed over
    (flashcodec: a group's patch pages)."""

    def __init__(self, conn: "_Served", call_id: int):
        self._conn, self._id, self._ended = conn, call_id, False

    def send(self, payload: Any) -> bool:
        return not self._ended and self._conn.reply((self._id, payload, False, None))

    def end(self, failure: StageFailure | None = None, last: Any = None) -> None:
        if not self._ended:
            self._ended = True
            self._conn.reply((self._id, last, True, failure))


Handler = Callable[[Call, Reply], None]  # (message, reply): must not block; ends the reply sooner or later


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
                call_id, message = conn.recv()
                reply = Reply(self, call_id)
                try:
                    if not isinstance(message, Call):
                        raise TypeError(f"not a protocol call: {type(message).__name__}")
                    self.handler(message, reply)
                except Exception as exc:  # a bad call fails alone; the link and the stage go on
                    log.exception("%s: call %s failed", self.name, type(message).__name__)
                    reply.end(StageFailure(SERVER_FAULT, f"{self.name}: {type(exc).__name__}: {exc}"))
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
    """A stage's end: listens on ``address(name)`` and runs ``handler(message, reply)`` for each call, on the
    connection's thread. Raises ValueError (socket path too long) or OSError (cannot listen)."""

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
    (the stage closed it or died), every open and later call fails with StageError (a server fault)."""

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
        """Connect once (later callers wait for the first); raises StageError naming why it could not."""
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
                        raise _fault(f"{self.name}: the stage's link {path} did not appear within "
                                        f"{self.connect_timeout_s:.0f} s (is the model loaded?)") from None
                    time.sleep(0.05)
                except OSError as exc:
                    sock.close()
                    raise _fault(f"{self.name}: cannot connect to {path}: {exc}") from exc
            try:
                conn = _handshake(sock, server=False)
            except Exception as exc:
                raise _fault(f"{self.name}: the link's handshake failed: {type(exc).__name__}: {exc}") from exc
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
                call_id, payload, final, failure = conn.recv()
                with self.lock:
                    target = self.calls.pop(call_id, None) if final else self.calls.get(call_id)
                if target is not None:
                    loop, replies = target
                    loop.call_soon_threadsafe(replies.put_nowait, (payload, final, failure))
        except (EOFError, OSError):
            pass
        except Exception as exc:  # a reply that will not unpickle, a loop that has closed
            log.exception("%s: the link's reader failed", self.name)
            reason = f"{self.name}: the link's reader failed: {type(exc).__name__}: {exc}"
        finally:
            self._fail(reason)

    async def connect(self) -> None:
        """Connect now, not at the first call (which, until then, is queued only when it is first read): raises
        StageError as a call would. The wait for the stage's socket to appear is on the loop (``run_dir.appeared``: a
        cancel ends it at once; the orchestrator starts at load, beside stages that may load for minutes), the
        connection made on a thread."""
        if self.conn is None:
            await appeared(address(self.name), self.connect_timeout_s)
            await asyncio.to_thread(self._connect)  # a no-op where another caller connected meanwhile

    def _fail(self, reason: str) -> None:
        """The link is gone: every open call fails with ``reason``, later ones at once; the socket is shut down, so
        the stage sees its end too (a writer or reader that failed otherwise leaves it open)."""
        with self.lock:
            self.closed = self.closed or reason
            calls, self.calls = self.calls, {}
        if self.conn is not None:
            _shut_down(self.conn)
        for loop, replies in calls.values():
            try:
                loop.call_soon_threadsafe(replies.put_nowait, (None, True, StageFailure(SERVER_FAULT, self.closed)))
            except RuntimeError:  # the loop has closed: nobody waits
                pass

    def busy(self) -> bool:
        """Whether any call is waiting for its end."""
        with self.lock:
            return bool(self.calls)

    def call(self, message: Call) -> AsyncIterator[Any]:
        """The replies to ``message``, as they come. Once the link is connected the call is queued for the
        writer thread here, before this returns, so calls made one after the other leave in that order (the
        first call connects, when it is first iterated). Iterating raises StageError with the stage's failure
        when the call fails, or a server fault when the link is gone (or cannot be made)."""
        return self._replies(message, self._start(message) if self.conn is not None else None)

    def _start(self, message: Call) -> tuple[int, asyncio.Queue] | StageError:
        """Register a call and queue it for the writer (or the error to raise, when the link is gone)."""
        replies: asyncio.Queue = asyncio.Queue()
        with self.lock:
            if self.closed:
                return _fault(self.closed)
            call_id = next(self.ids)
            self.calls[call_id] = (asyncio.get_running_loop(), replies)
            self.outbox.put((call_id, message))
        return call_id, replies

    async def _replies(self, message: Call, started) -> AsyncIterator[Any]:
        if started is None:
            await asyncio.to_thread(self._connect)
            started = self._start(message)
        if isinstance(started, StageError):
            raise started
        call_id, replies = started
        try:
            while True:
                payload, final, failure = await replies.get()
                if failure is not None:
                    raise StageError(failure)
                if final:
                    if payload is not None:  # end(last=payload)
                        yield payload
                    return
                yield payload
        finally:  # also when the caller stops early (cancelled): later replies are dropped
            with self.lock:
                self.calls.pop(call_id, None)

    async def request(self, message: Call) -> list[Any]:
        """All the replies to ``message`` once its call has ended (raises as :meth:`call`)."""
        return [payload async for payload in self.call(message)]

    def close(self) -> None:
        """Close the connection and join its threads (open calls fail with "closed")."""
        self._fail(f"{self.name}: the link was closed")
        self.outbox.put(None)
        if self.writer is not None:
            self.writer.join(timeout=5)
        if self.conn is not None:
            _hang_up(self.conn, self.reader)
