"""NVDEC sessions of one GPU in a helper process, so that one video can use several GPUs' engines at full speed.

The Python around each packet (demux, Annex B filter, `Decode` call) runs under one GIL per process, which bounds
how many sessions one process keeps busy (`bench/RESULTS.md`, "NVDEC, processes"). `NvdecDecoder` therefore
decodes on its first GPU in its own threads and, with `helper_processes`, on every other GPU in a helper process
(`NvdecHelper`) running an `NvdecDecoder` of that GPU alone; with `processes_per_gpu` > 1 each GPU's sessions are
split over that many processes, its first GPU's first share staying in the parent.

A helper process (`backends.ipc.helper_process`: spawn, handshake, the watch that notices it die or miss its
deadline), started as `python -m flashcodec.nvdec_remote FD GPU SESSIONS MAX_GOP_SIZE`. Its messages are pickled, and
torch's reductions pickle CUDA tensors as CUDA IPC handles, so frames never leave the GPU. After its handshake
(("failed", why) when it cannot open NVDEC), it runs (task id, path, StreamFormat, GopJob) messages on its sessions,
several at once, answering per part ("part", task id, part, frames: 3xHxW uint8 CUDA tensors on its GPU) or ("error",
task id, part, why), then ("done", task id, packets fed). It exits on None or when the parent's end closes. The
parent copies each frame to its output device (or to memory of its own on the helper's GPU), so the helper's memory
is let go at once.
"""
from __future__ import annotations

import logging
import math
import sys
import threading
import time
from concurrent.futures import Future, InvalidStateError
from functools import partial

import torch
import torch.multiprocessing  # noqa: F401  (registers the CUDA tensor reductions with the pickler)

from backends.ipc.helper_process import Exit, HelperProcess, HelperStartError, ParentLink
from flashcodec.gop_reader import GopJob
from flashcodec.nvdec_session import synchronize

log = logging.getLogger(__name__)
START_TIMEOUT_S = 120.0  # a helper imports torch and PyNvVideoCodec and queries its GPU
TASK_TIMEOUT_S = 300.0  # a task not over after this long has its helper killed (and the helper's other tasks fail)


class HelperError(RuntimeError):
    """The helper failed a part, died, or did not answer in time."""


class _Task:
    def __init__(self, futures: list[Future], output_device: torch.device | None):
        self.futures, self.output_device = futures, output_device
        self.deadline = time.monotonic() + TASK_TIMEOUT_S
        self.done, self.fed, self.error = threading.Event(), 0, ""


class NvdecHelper:
    """Parent side of one helper process decoding GOP jobs on GPU `gpu` with `sessions` NVDEC sessions.

    `run` is called by one of the parent's session threads per task (blocking until the task is over, so the
    parent keeps at most `sessions` tasks in flight per helper and its shared queue stays stall-free). A task not
    over within TASK_TIMEOUT_S s has the helper killed; a helper that has gone fails every task in flight, and
    `alive` turns false (`NvdecDecoder` then starts another for the next task). Raises HelperError when the process
    does not start within START_TIMEOUT_S s or cannot open NVDEC on `gpu`.
    """

    def __init__(self, gpu: int, sessions: int, max_gop_size: int):
        self.gpu, self.helper = gpu, None
        self._lock, self._tasks, self._next, self._gone = threading.Lock(), {}, 0, ""
        try:
            self.helper = HelperProcess("flashcodec.nvdec_remote", [gpu, sessions, max_gop_size],
                                        what=f"NVDEC helper for GPU {gpu}")
            self.helper.handshake(START_TIMEOUT_S)
        except HelperStartError as exc:
            self.close()
            raise HelperError(str(exc)) from exc
        self.helper.watch(self._on_message, self._on_exit, name=f"nvdec-helper-gpu{gpu}")

    @property
    def process(self):
        """The helper's `subprocess.Popen`."""
        return self.helper.process

    @property
    def alive(self) -> bool:
        return not self._gone and self.helper.alive

    def run(self, path: str, fmt, job: GopJob, futures: list[Future], output_device: torch.device | None) -> int:
        """Decode `job` of the video at `path` (stream format `fmt`) in the helper: each part's frames into its
        future as soon as it arrives (on `output_device`, else on the helper's GPU). Returns the packets fed to
        NVDEC. Raises HelperError when the helper failed a part, died, or took over TASK_TIMEOUT_S s."""
        task = _Task(futures, output_device)
        with self._lock:
            if self._gone:
                raise HelperError(f"the NVDEC helper for GPU {self.gpu} has exited")
            task_id, self._next = self._next, self._next + 1
            self._tasks[task_id] = task
            self._arm()
        try:
            try:
                self.helper.send((task_id, path, fmt, job))
            except OSError as exc:  # the helper has gone; its watch is about to see the end
                raise HelperError(f"the NVDEC helper for GPU {self.gpu} has exited ({exc})") from exc
            task.done.wait()  # set by a "done" message, or by `_on_exit` (the watch kills it past the deadline)
        finally:
            with self._lock:
                self._tasks.pop(task_id, None)
                self._arm()
        if task.error:
            raise HelperError(task.error)
        return task.fed

    def _arm(self) -> None:
        """The helper's deadline: the first of its tasks' (under the lock)."""
        self.helper.deadline = min((t.deadline for t in self._tasks.values()), default=math.inf)

    def _on_exit(self, exit: Exit) -> None:
        """The helper has gone (its watch thread): every task in flight fails."""
        why = (f"the NVDEC helper for GPU {self.gpu} did not finish a task in {TASK_TIMEOUT_S:.0f} s"
               if exit.timed_out else f"the NVDEC helper for GPU {self.gpu} exited")
        with self._lock:
            self._gone = why
            for task in self._tasks.values():
                task.error = task.error or why
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
                pass  # cancelled by a consumer that has gone
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
        """Stop the helper (it finishes the tasks it has), then its watch; kill it after 10 s."""
        if self.helper is not None:
            self.helper.close(10.0)


def serve(fd: int, gpu: int, sessions: int, max_gop_size: int) -> None:
    """The helper: an `NvdecDecoder` of GPU `gpu` running the parent's jobs (see the module's protocol)."""
    from flashcodec.nvdec import NvdecDecoder

    def build() -> NvdecDecoder:
        torch.cuda.set_device(gpu)
        return NvdecDecoder(gpu, sessions_per_gpu=sessions, max_gop_size=max_gop_size, output_device=None)

    parent = ParentLink(fd)
    decoder = parent.start(build)

    def part_done(task_id: int, part: int, future: Future) -> None:
        if future.exception() is not None:
            parent.send(("error", task_id, part, str(future.exception())))
            return
        try:
            parent.send(("part", task_id, part, future.result()))
        except OSError:
            pass  # the parent is gone
        except Exception as exc:  # frames that will not pickle as CUDA IPC handles
            parent.send(("error", task_id, part, f"frames not sent: {type(exc).__name__}: {exc}"))

    def task_done(task_id: int, future: Future) -> None:
        parent.send(("done", task_id, future.result() if future.exception() is None else 0))

    while (message := parent.receive()) is not None:
        torch.cuda.ipc_collect()  # frees the frames of earlier tasks that the parent has copied
        task_id, path, fmt, job = message
        futures = [Future() for _ in job.task.parts]
        for part, future in enumerate(futures):
            future.add_done_callback(partial(part_done, task_id, part))
        decoder.run_job_later(path, fmt, job, futures).add_done_callback(partial(task_done, task_id))
    decoder.close()


if __name__ == "__main__":
    serve(*(int(a) for a in sys.argv[1:5]))
