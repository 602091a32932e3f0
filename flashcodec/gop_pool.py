"""A pool of long-lived PyAV decoder processes running GOP jobs (`gop_reader.GopJob`) first come, first served.

Processes, not threads: FFmpeg's software decoders release the GIL but the per-frame Python around them
(packet loop, RGB conversion, rotation) does not. Workers are fresh interpreters (`python -m
flashcodec.gop_worker FD THREADS`, like multiprocessing's 'spawn'), started with `subprocess` and an explicit
interpreter (`python_executable`) rather than `multiprocessing.Process`: inside Triton's Python-backend stub
`sys.executable` is the stub binary, and 'spawn' would also re-run the host's `__main__` in every worker;
'fork' would copy the stub's threads and CUDA state. The parent's `sys.path` is passed as PYTHONPATH so the
workers import the same flashcodec and PyAV. Messages are pickled over a socket pair
(`multiprocessing.connection.Connection`); frames follow as raw bytes on the same socket, received straight into
their arrays (`Connection.recv_bytes_into` would copy each frame three times).
"""
from __future__ import annotations

import logging
import multiprocessing.connection
import os
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from flashcodec.errors import MediaError
from flashcodec.gop_reader import DemuxMismatch, GopJob
from flashcodec.gop_worker import receive
from flashcodec.interpreter import NoInterpreter, python_executable

log = logging.getLogger(__name__)
SOCKET_BUFFER = 4 << 20  # bytes


class PoolUnavailable(RuntimeError):
    """The worker processes could not be started (no usable python3, or it cannot import flashcodec)."""


@dataclass
class _Task:
    id: int
    path: str
    job: GopJob
    futures: list[Future]
    parts_done: int = 0


@dataclass
class _Worker:
    process: subprocess.Popen
    conn: multiprocessing.connection.Connection
    raw: socket.socket  # the same socket, for frame bytes
    ready: bool = False
    task: _Task | None = None
    deadline: float = field(default=float("inf"))  # time.monotonic() by which the next message must come


class WorkerPool:
    """`workers` long-lived decoder processes sharing one first-come first-served queue of GOP jobs.

    A free worker always takes the next job (stall-free). Each job must produce its next part within
    `part_timeout_s` seconds of the previous one (or of its start); a worker that does not is killed and
    replaced, and the job's remaining parts fail with MediaError naming the timeout. A worker that dies fails
    its job the same way. `threads`: FFmpeg threads per worker. Raises PoolUnavailable if the workers do not
    all start within `start_timeout_s` seconds.
    """

    def __init__(self, workers: int, part_timeout_s: float = 60.0, threads: int = 1, start_timeout_s: float = 60.0):
        if workers < 1 or part_timeout_s <= 0:
            raise ValueError(f"workers must be >= 1 and part_timeout_s > 0, got {workers}, {part_timeout_s}")
        self.part_timeout_s, self.threads = part_timeout_s, threads
        try:
            self._python = python_executable()
        except NoInterpreter as exc:
            raise PoolUnavailable(str(exc)) from exc
        self._queue: deque[_Task] = deque()
        self._lock = threading.Lock()
        self._next_id = 0
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._workers = [self._spawn() for _ in range(workers)]
        deadline = time.monotonic() + start_timeout_s
        for worker in self._workers:
            if not worker.conn.poll(max(0.0, deadline - time.monotonic())) or not self._handshake(worker):
                self.close()
                raise PoolUnavailable(f"decoder process {worker.process.pid} ({self._python}) did not start")
        self._thread = threading.Thread(target=self._loop, name="flashcodec-gop-pool", daemon=True)
        self._thread.start()

    def _spawn(self) -> _Worker:
        parent, child = socket.socketpair()
        for end in (parent, child):  # fewer wake-ups per frame of several MB
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        command = [self._python, "-m", "flashcodec.gop_worker", str(child.fileno()), str(self.threads)]
        process = subprocess.Popen(command, pass_fds=[child.fileno()], env=env, stdin=subprocess.DEVNULL)
        child.close()
        return _Worker(process, multiprocessing.connection.Connection(os.dup(parent.fileno())), parent)

    @staticmethod
    def _handshake(worker: _Worker) -> bool:
        message = receive(worker.conn)
        worker.ready = message == ("ready", tuple(sys.version_info[:2]))  # pickles must match the parent's Python
        return worker.ready

    def pids(self) -> list[int]:
        """Process ids of the live workers (for tests and process metrics)."""
        return [w.process.pid for w in self._workers]

    def submit(self, path: str, job: GopJob) -> list[Future]:
        """Queue `job` on the video file at `path`; one Future per part of `job.task`, resolving to that part's
        frames (HxWx3 uint8 arrays, None where a frame did not decode). Cancel the futures to drop a job that
        has not started. Raises RuntimeError after `close`."""
        futures = [Future() for _ in job.task.parts]
        with self._lock:
            if self._closed:
                raise RuntimeError("the GOP decoder pool is closed")
            self._queue.append(_Task(self._next_id, path, job, futures))
            self._next_id += 1
            self._wake()  # under the lock: `close` closes the pipe only after marking the pool closed
        return futures

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full: the dispatcher is already due to wake

    def _close_queue(self, why: str) -> None:
        """Refuse new jobs and fail the queued ones with RuntimeError(`why`)."""
        with self._lock:
            self._closed = True
            queued, self._queue = list(self._queue), deque()
        for task in queued:
            _fail(task, RuntimeError(why))

    def close(self) -> None:
        """Stop the dispatcher and the workers; queued and running jobs fail with RuntimeError. Idempotent."""
        if self._wake_w is None:
            return
        self._close_queue("the GOP decoder pool was closed")
        self._wake()
        if getattr(self, "_thread", None) is not None and self._thread is not threading.current_thread():
            self._thread.join()
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except OSError:
                pass
        for worker in self._workers:
            try:
                worker.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()
            worker.conn.close()
            worker.raw.close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        self._workers, self._wake_r, self._wake_w = [], None, None

    def _loop(self) -> None:
        while not self._closed:
            try:
                self._step()
            except Exception:  # a bug here must not strand every waiting request: log it and go on
                log.exception("GOP decoder pool dispatcher")
        for worker in self._workers:
            if worker.task is not None:
                _fail(worker.task, RuntimeError("the GOP decoder pool was closed"))

    def _step(self) -> None:
        now = time.monotonic()
        timeout = max(0.0, min((w.deadline for w in self._workers), default=now + 1) - now)
        conns = {w.conn: w for w in self._workers}
        for ready in multiprocessing.connection.wait([*conns, self._wake_r], timeout=min(timeout, 1.0)):
            if ready == self._wake_r:
                os.read(self._wake_r, 4096)
            else:
                self._on_message(conns[ready])
        self._expire()
        self._dispatch()

    def _dispatch(self) -> None:
        for worker in self._workers:
            if not worker.ready or worker.task is not None:
                continue
            with self._lock:
                task = None
                while self._queue and task is None:
                    task = self._queue.popleft()
                    started = [f.set_running_or_notify_cancel() for f in task.futures]
                    if not any(started):
                        task = None  # every part cancelled: its consumer has gone
            if task is None:
                return
            worker.task, worker.deadline = task, time.monotonic() + self.part_timeout_s
            try:
                worker.conn.send((task.id, task.path, task.job))
            except OSError:
                self._replace(worker, "exited")

    def _on_message(self, worker: _Worker) -> None:
        try:
            message = worker.conn.recv()
            if not worker.ready:
                worker.ready = message == ("ready", tuple(sys.version_info[:2]))
                return
            kind, task = message[0], worker.task
            if kind == "part":
                _, _, part, shapes = message
                frames = [None if s is None else np.empty(s, np.uint8) for s in shapes]
                for frame in frames:
                    if frame is not None:
                        _recv_exact(worker.raw, memoryview(frame.reshape(-1)))
                _settle(task.futures[part], result=frames)
                task.parts_done = part + 1
                worker.deadline = time.monotonic() + self.part_timeout_s
                return
            if kind == "media_error":
                _fail(task, MediaError(message[2]))
            elif kind == "mismatch":
                _fail(task, DemuxMismatch(message[2]))
            elif kind == "error":
                _fail(task, RuntimeError(f"GOP decoder process: {message[2]}"))
            worker.task, worker.deadline = None, float("inf")
        except (EOFError, OSError):
            self._replace(worker, f"exited (code {worker.process.poll()})")

    def _expire(self) -> None:
        now = time.monotonic()
        for worker in self._workers:
            if worker.task is not None and now > worker.deadline:
                worker.process.kill()
                self._replace(worker, f"timed out: no frames within {self.part_timeout_s:g} s")

    def _replace(self, worker: _Worker, what: str) -> None:
        """Reap the worker, start a new one in its place (it takes jobs once its handshake comes), then fail
        the job it had with MediaError."""
        try:
            worker.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            worker.process.kill()  # a worker that broke its protocol but is still running
            worker.process.wait()
        worker.conn.close()
        worker.raw.close()
        if worker.ready:
            fresh = self._spawn()
            self._workers[self._workers.index(worker)] = fresh
            log.warning("GOP decoder process %s %s; started %s", worker.process.pid, what, fresh.process.pid)
        else:  # a replacement that died before its handshake: starting more would loop
            self._workers.remove(worker)
            log.error("GOP decoder process %s %s before starting; %d left", worker.process.pid, what,
                      len(self._workers))
            if not self._workers:
                self._close_queue("no GOP decoder processes are left")
        if worker.task is not None:
            _fail(worker.task, MediaError(f"video: decoding {what} on GOP task {worker.task.job.task.index} "
                                          f"(decoder process {worker.process.pid}, now replaced)"))


def _recv_exact(raw: socket.socket, view: memoryview) -> None:
    while view:
        received = raw.recv_into(view)
        if not received:
            raise EOFError("the decoder process closed its socket mid-frame")
        view = view[received:]


def _settle(future: Future, result=None, error: BaseException | None = None) -> None:
    if future.done():
        return  # cancelled before it started: nobody reads it
    if future.running() or future.set_running_or_notify_cancel():
        future.set_exception(error) if error is not None else future.set_result(result)


def _fail(task: _Task, error: BaseException) -> None:
    for future in task.futures[task.parts_done:]:
        _settle(future, error=error)
