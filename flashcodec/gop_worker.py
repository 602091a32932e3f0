"""A GOP-parallel CPU worker process: runs GOP jobs from its parent (`gop_pool.WorkerPool`) with PyAV.

A helper process (`backends.ipc.helper_process`): started as `python -m flashcodec.gop_worker FD THREADS`. After
its handshake, for each (task id, path, GopJob) message it sends ("part", task id, part, shapes) followed by that
part's frames as raw bytes, and ("done", task id) or an error message; it exits on None or when its parent's end
closes.
"""
from __future__ import annotations

import sys

import numpy as np

from backends.ipc.helper_process import ParentLink
from flashcodec.errors import MediaError
from flashcodec.gop_reader import DemuxMismatch, ReaderCache

READERS = 4  # open containers kept (concurrent requests interleave their tasks)


def serve(fd: int, threads: int) -> None:
    """A worker on socket `fd` with `threads` FFmpeg threads: the handshake, then (task id, path, GopJob) messages
    until EOF or None. Each part is a ("part", task id, part, shapes) message, then its frames' raw bytes."""
    parent = ParentLink(fd)
    parent.ready()
    readers = ReaderCache(threads, READERS)
    while (message := parent.receive()) is not None:
        task_id, path, job = message
        try:
            reader = readers.get(path)
            for part, frames in enumerate(reader.run(job)):
                parent.send(("part", task_id, part, [None if f is None else f.shape for f in frames]))
                for frame in frames:
                    if frame is not None:
                        parent.send_raw(np.ascontiguousarray(frame).reshape(-1))
            parent.send(("done", task_id))
        except Exception as exc:  # report and stay alive for the next task
            parent.send(_error(task_id, exc))
            readers.clear()


def _error(task_id: int, exc: Exception) -> tuple:
    if isinstance(exc, MediaError):
        return "media_error", task_id, str(exc)
    if isinstance(exc, DemuxMismatch):
        return "mismatch", task_id, str(exc)
    return "error", task_id, f"{type(exc).__name__}: {exc}"


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
