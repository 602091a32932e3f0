"""NVDEC sessions of one GPU in a helper process, so that one video can use several GPUs' engines at full speed.

The Python around each packet (demux, Annex B filter, `Decode` call) runs under one GIL per process: one process
feeding the sessions of two H200s reached 0.73 parallel efficiency, one process per GPU 0.86 and two per GPU 0.92
(bench/results/flashcodec-baselines-h200x2-2026-11-29, `bench/nvdec_process_probe.py`). `NvdecDecoder` therefore
decodes on its first GPU in its own threads and, with `helper_processes`, on every other GPU in a helper process
(`NvdecHelper`) running an `NvdecDecoder` of that GPU alone; with `processes_per_gpu` > 1 each GPU's sessions are
split over that many processes, its first GPU's first share staying in the parent.

Protocol on a socket pair (`multiprocessing.connection`, pickled; torch's reductions pickle CUDA tensors as CUDA
IPC handles, so frames never leave the GPU): the helper answers ("ready", python version) or ("failed", why), then
runs (task id, path, StreamFormat, GopJob) messages on its sessions, several at once, answering per part
("part", task id, part, frames: 3xHxW uint8 CUDA tensors on its GPU) or ("error", task id, part, why), then
("done", task id, packets fed). It exits on None or when the parent's end closes. The parent copies each frame to
its output device (or to memory of its own on the helper's GPU), so the helper's memory is let go at once.
"""
from __future__ import annotations

import logging
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future, InvalidStateError
from functools import partial

import torch
import torch.multiprocessing  # noqa: F401  (registers the CUDA tensor reductions with the pickler)

from flashcodec.interpreter import python_executable
from flashcodec.gop_reader import GopJob
from flashcodec.gop_worker import receive
from flashcodec.nvdec_session import synchronize

log = logging.getLogger(__name__)
START_TIMEOUT_S = 120.0  # a helper imports torch and PyNvVideoCodec and queries its GPU
TASK_TIMEOUT_S = 300.0  # a task not over after this long has its helper killed (and the helper's other tasks fail)


class HelperError(RuntimeError):
    """The helper failed a part, died, or did not answer in time."""


class _Task:
    def __init__(self, futures: list[Future], output_device: torch.device | None):
        self.futures, self.output_device = futures, output_device
        self.done, self.fed, self.error = threading.Event(), 0, ""


class NvdecHelper:
    """Parent side of one helper process decoding GOP jobs on GPU `gpu` with `sessions` NVDEC sessions.

    `run` is called by one of the parent's session threads per task (blocking until the task is over, so the
    parent keeps at most `sessions` tasks in flight per helper and its shared queue stays stall-free). Raises
    HelperError when the process does not start within START_TIMEOUT_S s or cannot open NVDEC on `gpu`.
    """

    def __init__(self, gpu: int, sessions: int, max_gop_size: int):
        self.gpu, self.process, self.conn, self._reader = gpu, None, None, None
        self._lock, self._send_lock, self._tasks, self._next = threading.Lock(), threading.Lock(), {}, 0
        self.alive = False
        parent, child = socket.socketpair()
        try:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
            command = [python_executable(), "-m", "flashcodec.nvdec_remote", str(child.fileno()), str(gpu),
                       str(sessions), str(max_gop_size)]
            self.process = subprocess.Popen(command, pass_fds=[child.fileno()], env=env, stdin=subprocess.DEVNULL)
            child.close()  # the helper's end only there: a helper that dies is seen at once, not at the timeout
            self.conn = multiprocessing.connection.Connection(parent.detach())
            answer = receive(self.conn) if self.conn.poll(START_TIMEOUT_S) else None
        except Exception as exc:  # no interpreter, no process, an answer that does not unpickle
            answer = f"{type(exc).__name__}: {exc}"
        finally:
            child.close()
            parent.close()  # both no-ops where done already (closed, detached into the connection)
        if answer != ("ready", tuple(sys.version_info[:2])):
            self.close()
            raise HelperError(f"NVDEC helper for GPU {gpu} did not start: {answer!r}")
        self.alive = True
        self._reader = threading.Thread(target=self._read, name=f"nvdec-helper-gpu{gpu}", daemon=True)
        self._reader.start()

    def run(self, path: str, fmt, job: GopJob, futures: list[Future], output_device: torch.device | None) -> int:
        """Decode `job` of the video at `path` (stream format `fmt`) in the helper: each part's frames into its
        future as soon as it arrives (on `output_device`, else on the helper's GPU). Returns the packets fed to
        NVDEC. Raises HelperError when the helper failed a part, died, or took over TASK_TIMEOUT_S s."""
        task = _Task(futures, output_device)
        with self._lock:
            if not self.alive:
                raise HelperError(f"the NVDEC helper for GPU {self.gpu} has exited")
            task_id, self._next = self._next, self._next + 1
            self._tasks[task_id] = task
        try:
            try:
                with self._send_lock:
                    self.conn.send((task_id, path, fmt, job))
            except OSError as exc:  # the helper has gone; its reader is about to see the end
                raise HelperError(f"the NVDEC helper for GPU {self.gpu} has exited ({exc})") from exc
            if not task.done.wait(TASK_TIMEOUT_S):
                self.process.kill()  # the reader sees the end and fails every task
                task.done.wait(10)
                raise HelperError(f"the NVDEC helper for GPU {self.gpu} did not finish a task in "
                                  f"{TASK_TIMEOUT_S:.0f} s")
        finally:
            with self._lock:
                self._tasks.pop(task_id, None)
        if task.error:
            raise HelperError(task.error)
        return task.fed

    def _read(self) -> None:
        """Settles tasks from the helper's messages; when the helper has gone (or this thread fails), marks it
        dead and fails every task in flight, so that none waits for nothing."""
        try:
            while (message := receive(self.conn)) is not None:
                self._on_message(message)
                message = None  # lets the helper free the frames before the next message comes
        except Exception:  # a message that does not unpickle (a CUDA IPC handle that will not open), a bug
            log.exception("NVDEC helper for GPU %d: unreadable message; stopping the helper", self.gpu)
            self.process.kill()
        finally:
            with self._lock:
                self.alive = False
                for task in self._tasks.values():
                    task.error = task.error or f"the NVDEC helper for GPU {self.gpu} exited"
                    task.done.set()

    def _on_message(self, message: tuple) -> None:
        kind, task_id = message[0], message[1]
        with self._lock:
            task = self._tasks.get(task_id)
        if task is None:
            return
        if kind == "part":
            try:
                frames = self._own(message[3], task.output_device)
                task.futures[message[2]].set_result(frames)
            except InvalidStateError:
                pass  # cancelled by a consumer that has gone, or failed by a `run` that timed out
            except Exception as exc:  # the task fails, the helper goes on
                task.error = task.error or f"frames from GPU {self.gpu}: {type(exc).__name__}: {exc}"
        elif kind == "error":
            task.error = task.error or message[3]
        else:  # "done"
            task.fed = message[2]
            task.done.set()

    def _own(self, frames: list[torch.Tensor], device: torch.device | None) -> list[torch.Tensor]:
        """Copies of the helper's frames in this process's memory, synchronised (the consumer is another thread)."""
        target = device or torch.device("cuda", self.gpu)
        copies = [frame.to(target, non_blocking=True) if target != frame.device else frame.clone() for frame in frames]
        synchronize({target, torch.device("cuda", self.gpu)})
        return copies

    def close(self) -> None:
        """Stop the helper (it finishes the tasks it has), then its reader; kill it after 10 s."""
        if self.conn is not None:
            try:
                with self._send_lock:
                    self.conn.send(None)
            except OSError:
                pass
        if self.process is not None:
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._reader is not None:
            self._reader.join(10)  # it sees the end of the stream: never close the socket under it
        if self.conn is not None:
            self.conn.close()


def serve(fd: int, gpu: int, sessions: int, max_gop_size: int) -> None:
    """The helper: an `NvdecDecoder` of GPU `gpu` running the parent's jobs (see the module's protocol)."""
    from flashcodec.nvdec import NvdecDecoder

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and closes its helpers
    conn, lock = multiprocessing.connection.Connection(fd), threading.Lock()

    def send(message) -> None:
        with lock:
            conn.send(message)

    try:
        torch.cuda.set_device(gpu)
        decoder = NvdecDecoder(gpu, sessions_per_gpu=sessions, max_gop_size=max_gop_size, output_device=None)
    except Exception as exc:
        send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    send(("ready", tuple(sys.version_info[:2])))

    def part_done(task_id: int, part: int, future: Future) -> None:
        if future.exception() is not None:
            send(("error", task_id, part, str(future.exception())))
            return
        try:
            send(("part", task_id, part, future.result()))
        except OSError:
            pass  # the parent is gone
        except Exception as exc:  # frames that will not pickle as CUDA IPC handles
            send(("error", task_id, part, f"frames not sent: {type(exc).__name__}: {exc}"))

    def task_done(task_id: int, future: Future) -> None:
        send(("done", task_id, future.result() if future.exception() is None else 0))

    while (message := receive(conn)) is not None:
        torch.cuda.ipc_collect()  # frees the frames of earlier tasks that the parent has copied
        task_id, path, fmt, job = message
        futures = [Future() for _ in job.task.parts]
        for part, future in enumerate(futures):
            future.add_done_callback(partial(part_done, task_id, part))
        decoder.run_job_later(path, fmt, job, futures).add_done_callback(partial(task_done, task_id))
    decoder.close()


if __name__ == "__main__":
    serve(*(int(a) for a in sys.argv[1:5]))
