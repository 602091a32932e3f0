"""A GOP-parallel CPU worker process: runs GOP jobs from its parent (`gop_pool.WorkerPool`) with PyAV.

Started as `python -m flashcodec.gop_worker FD THREADS` with a connected socket as FD. It answers
("ready", python version), then for each (task id, path, GopJob) message sends ("part", task id, part, shapes)
followed by that part's frames as raw bytes, and ("done", task id) or an error message; it exits on None or
when its parent's end closes.
"""
from __future__ import annotations

import multiprocessing.connection
import os
import signal
import socket
import sys

import numpy as np

from flashcodec.errors import MediaError
from flashcodec.gop_reader import DemuxMismatch, ReaderCache

READERS = 4  # open containers kept (concurrent requests interleave their tasks)


def serve(fd: int, threads: int) -> None:
    """A worker on socket `fd`: answer ("ready", python version), then run (task id, path, GopJob) messages
    until EOF or None. Each part is a ("part", task id, part, shapes) message, then its frames' raw bytes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and closes the pool
    conn, raw = multiprocessing.connection.Connection(fd), socket.socket(fileno=os.dup(fd))
    conn.send(("ready", tuple(sys.version_info[:2])))
    readers = ReaderCache(threads, READERS)
    while (message := receive(conn)) is not None:
        task_id, path, job = message
        try:
            reader = readers.get(path)
            for part, frames in enumerate(reader.run(job)):
                conn.send(("part", task_id, part, [None if f is None else f.shape for f in frames]))
                for frame in frames:
                    if frame is not None:
                        raw.sendall(np.ascontiguousarray(frame).reshape(-1))
            conn.send(("done", task_id))
        except Exception as exc:  # report and stay alive for the next task
            conn.send(_error(task_id, exc))
            readers.clear()


def _error(task_id: int, exc: Exception) -> tuple:
    if isinstance(exc, MediaError):
        return "media_error", task_id, str(exc)
    if isinstance(exc, DemuxMismatch):
        return "mismatch", task_id, str(exc)
    return "error", task_id, f"{type(exc).__name__}: {exc}"


def receive(conn: multiprocessing.connection.Connection):
    """The next message, or None when the other end has closed."""
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None  # the parent is gone


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
