"""A pool of long-lived PyAV decoder processes running GOP jobs (`gop_reader.GopJob`), shared fairly between videos.

Processes, not threads: FFmpeg's software decoders release the GIL but the per-frame Python around them
(packet loop, RGB conversion, rotation) does not. Each worker is a helper process (`backends.ipc.helper_process`:
a fresh interpreter running `flashcodec.gop_worker`, its handshake, a watch thread per worker). Jobs are pickled
to it; frames come back as raw bytes after their message, received straight into their arrays
(`Connection.recv_bytes_into` would copy each frame three times).
"""
from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Hashable

import numpy as np

from backends.ipc.helper_process import Exit, HelperProcess, HelperStartError, close_all, handshake_all
from flashcodec.errors import MediaError
from flashcodec.fair_queue import FairQueue
from flashcodec.gop_reader import DemuxMismatch, GopJob

log = logging.getLogger(__name__)
SOCKET_BUFFER = 4 << 20  # bytes


class PoolUnavailable(RuntimeError):
    """The worker processes could not be started (no usable python3, or it cannot import flashcodec)."""


@dataclass
class _Task:
    id: int
    key: Hashable  # the video decode it belongs to (its queue)
    path: str
    job: GopJob
    futures: list[Future]
    parts_done: int = 0


@dataclass(eq=False)
class _Worker:
    helper: HelperProcess
    ready: bool = False  # its handshake has come: it takes jobs
    task: _Task | None = field(default=None)


class WorkerPool:
    """`workers` long-lived decoder processes sharing a fair queue of GOP jobs (`fair_queue.FairQueue`).

    A free worker always takes a job when one is queued (stall-free): the next job of the video decode (`submit`'s
    `key`) with the fewest jobs running, so that a video submitted beside another's window of jobs starts on the
    next free worker instead of waiting for that window (issue 18). Each job must produce its next part within
    `part_timeout_s` seconds of the previous one (or of its start); a worker that does not is killed and
    replaced, and the job's remaining parts fail with MediaError naming the timeout. A worker that dies fails
    its job the same way; a replacement that dies before its handshake is not replaced again. `threads`: FFmpeg
    threads per worker. Raises PoolUnavailable if the workers do not all start within `start_timeout_s` seconds.
    """

    def __init__(self, workers: int, part_timeout_s: float = 60.0, threads: int = 1, start_timeout_s: float = 60.0):
        if workers < 1 or part_timeout_s <= 0:
            raise ValueError(f"workers must be >= 1 and part_timeout_s > 0, got {workers}, {part_timeout_s}")
        self.part_timeout_s, self.threads, self.start_timeout_s = part_timeout_s, threads, start_timeout_s
        self._queue: FairQueue[Hashable, _Task] = FairQueue(workers)
        self._lock = threading.Lock()  # the queue, the worker list, each worker's task
        self._next_id = 0
        self._closed = False
        self._workers: list[_Worker] = []
        try:
            for _ in range(workers):
                self._workers.append(_Worker(self._spawn()))
            handshake_all([w.helper for w in self._workers], start_timeout_s)
        except HelperStartError as exc:
            close_all([w.helper for w in self._workers])
            raise PoolUnavailable(str(exc)) from exc
        for worker in self._workers:
            worker.ready = True
            self._watch(worker, handshake_s=None)

    def _spawn(self) -> HelperProcess:
        return HelperProcess("flashcodec.gop_worker", [self.threads], what="GOP decoder process",
                             socket_buffer=SOCKET_BUFFER)

    def _watch(self, worker: _Worker, handshake_s: float | None) -> None:
        worker.helper.watch(partial(self._on_message, worker), partial(self._on_exit, worker),
                            handshake_s=handshake_s, on_ready=partial(self._on_ready, worker),
                            name=f"flashcodec-gop-worker-{worker.helper.pid}")

    def pids(self) -> list[int]:
        """Process ids of the live workers (for tests and process metrics)."""
        with self._lock:
            return [w.helper.pid for w in self._workers]

    def submit(self, path: str, job: GopJob, key: Hashable) -> list[Future]:
        """Queue `job` on the video file at `path` after the other jobs of `key` (one video decode); one Future per
        part of `job.task`, resolving to that part's frames (HxWx3 uint8 arrays, None where a frame did not
        decode). Cancel the futures to drop a job that has not started. Raises RuntimeError after `close`."""
        futures = [Future() for _ in job.task.parts]
        with self._lock:
            if self._closed:
                raise RuntimeError("the GOP decoder pool is closed")
            self._queue.put(key, _Task(self._next_id, key, path, job, futures))
            self._next_id += 1
        self._dispatch()
        return futures

    def _close_queue(self, why: str) -> None:
        """Refuse new jobs and fail the queued ones with RuntimeError(`why`)."""
        with self._lock:
            self._closed = True
            queued = [task for _, task in self._queue.drain()]
        for task in queued:
            _fail(task, RuntimeError(why))

    def close(self) -> None:
        """Stop the workers; queued and running jobs fail with RuntimeError. Idempotent."""
        self._close_queue("the GOP decoder pool was closed")
        with self._lock:
            workers, self._workers = self._workers, []
            running = [w.task for w in workers if w.task is not None]
            for worker in workers:
                self._free(worker)
        for task in running:
            _fail(task, RuntimeError("the GOP decoder pool was closed"))
        close_all([w.helper for w in workers], 2.0)

    def _dispatch(self) -> None:
        """Free workers take the next jobs (called on a submit, and when a worker becomes free)."""
        while True:
            with self._lock:
                worker = next((w for w in self._workers if w.ready and w.task is None), None)
                task = self._next_task() if worker is not None else None
                if task is None:
                    return
                worker.task = task
                worker.helper.deadline = time.monotonic() + self.part_timeout_s
            try:
                worker.helper.send((task.id, task.path, task.job))
            except OSError:
                pass  # the worker has gone: its watch fails the job and replaces it

    def _next_task(self) -> _Task | None:
        """The next queued job by the fair rule whose consumer still wants a part, counted running (under the
        lock)."""
        while (taken := self._queue.take()) is not None:
            task = taken[1]
            if any([f.set_running_or_notify_cancel() for f in task.futures]):
                return task
            self._queue.done(task.key)  # every part cancelled: its consumer has gone
        return None

    def _free(self, worker: _Worker) -> _Task | None:
        """Take `worker`'s task off it, its slot in the queue freed (under the lock); returns the task."""
        task, worker.task = worker.task, None
        if task is not None:
            self._queue.done(task.key)
        return task

    def _on_ready(self, worker: _Worker) -> None:
        with self._lock:
            worker.ready = True
        self._dispatch()

    def _on_message(self, worker: _Worker, message: tuple) -> None:
        """A worker's message (on its watch thread): a part's frames, or the end of its job."""
        kind, task_id = message[0], message[1]
        if kind == "part":
            _, _, part, shapes = message
            frames = [None if s is None else np.empty(s, np.uint8) for s in shapes]
            for frame in frames:
                if frame is not None:
                    worker.helper.recv_raw_into(memoryview(frame.reshape(-1)))
            with self._lock:
                task = worker.task if worker.task is not None and worker.task.id == task_id else None
                if task is not None:
                    task.parts_done = part + 1
                    worker.helper.deadline = time.monotonic() + self.part_timeout_s
            if task is not None:
                _settle(task.futures[part], result=frames)
            return
        with self._lock:
            task = worker.task if worker.task is not None and worker.task.id == task_id else None
            if task is not None:
                self._free(worker)
                worker.helper.deadline = math.inf
        if task is not None and kind == "media_error":
            _fail(task, MediaError(message[2]))
        elif task is not None and kind == "mismatch":
            _fail(task, DemuxMismatch(message[2]))
        elif task is not None and kind == "error":
            _fail(task, RuntimeError(f"GOP decoder process: {message[2]}"))
        self._dispatch()

    def _on_exit(self, worker: _Worker, exit: Exit) -> None:
        """A worker has gone (on its watch thread): a new one takes its place (it takes jobs once its handshake
        comes), then the job it had fails with MediaError."""
        what = f"timed out: no frames within {self.part_timeout_s:g} s" if exit.timed_out else str(exit)
        pid = worker.helper.pid
        with self._lock:
            if self._closed or worker not in self._workers:
                return  # closing: its job has failed already
            task = self._free(worker)
            index = self._workers.index(worker)
            fresh = None
            if worker.ready:
                try:
                    fresh = _Worker(self._spawn())
                except HelperStartError as exc:
                    what = f"{what}, and {exc}"
            if fresh is not None:
                self._workers[index] = fresh
                self._watch(fresh, handshake_s=self.start_timeout_s)
            else:  # a replacement that died before its handshake: starting more would loop
                del self._workers[index]
            left = len(self._workers)
        if fresh is not None:
            log.warning("GOP decoder process %s %s; started %s", pid, what, fresh.helper.pid)
        else:
            log.error("GOP decoder process %s %s%s; %d left", pid, what, " before starting" * (not worker.ready),
                      left)
        if not left:
            self._close_queue("no GOP decoder processes are left")
        if task is not None:
            _fail(task, MediaError(f"video: decoding {what} on GOP task {task.job.task.index} "
                                   f"(decoder process {pid}, now replaced)"))


def _settle(future: Future, result=None, error: BaseException | None = None) -> None:
    if future.done():
        return  # cancelled before it started: nobody reads it
    if future.running() or future.set_running_or_notify_cancel():
        future.set_exception(error) if error is not None else future.set_result(result)


def _fail(task: _Task, error: BaseException) -> None:
    for future in task.futures[task.parts_done:]:
        _settle(future, error=error)
