"""NVDEC decoding through PyNvVideoCodec 2.x: one video's GOP tasks on the decoder sessions of one or more GPUs.

Imports without PyNvVideoCodec or a GPU (the library is imported when a decoder is built). Each session is a
`CreateDecoder` session (NV12/P016 output in GPU memory, made RGB by `nvdec_session.yuv_to_rgb`) owned by one
thread, and each thread is bound to one GPU for its life; all threads take GOP tasks (`gop_plan`) from one shared
queue, so a free session on any GPU takes the next task of any video (FlashCodec's GOP i -> GPU i mod N, without its
stalls behind a slow GPU), and frames stream back in order (`gop_plan.frames_in_order`) on one output device,
peer-copied there from the GPU that decoded them. A task's packets are read with PyAV and fed one by one
(`gop_reader.GopReader` with `nvdec_session.NvdecPackets`): from each GOP's keyframe up to its last sampled frame,
leaving out disposable pictures that are not sampled, which NVDEC then never decodes (about half the frames of a
B-frame stream). `unsupported_reason` sends to the CPU decoder given as `fallback`: streams NVDEC cannot take
(codec, chroma format, bit depth or size outside `GetDecoderCaps` of any of the GPUs, e.g. 4:4:4 H.264 or AV1 on
H100/H200) and packets without unique, unbroken timestamps (frames are matched by PTS); so do NVDEC errors, including a
sampled frame NVDEC never returned. Every fallback is logged at WARNING with its reason, kept in
`NvdecDecoder.fallbacks` and counted per reason in `DecodePaths`; the video is counted under the path that decoded
it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Iterator, Sequence

import torch

from flashcodec.decoders import CpuDecoder, DecodePaths, FrameDecoder
from flashcodec.gop import BitstreamMap, map_for_indices
from flashcodec.gop_plan import MAX_GOP_SIZE, DecodeTask, frames_in_order, plan_gop_tasks
from flashcodec.gop_reader import GopJob, ReaderCache
from flashcodec.nvdec_caps import CODECS, DecoderCaps, NvdecUnavailable, StreamFormat, load_pynvvideocodec
from flashcodec.nvdec_remote import HelperError, NvdecHelper
from flashcodec.nvdec_session import NvdecPackets, synchronize
from flashcodec.nvdec_slots import SessionStats, interleave, session_processes
from flashcodec.parallel import as_file
from flashcodec.probe import Source

log = logging.getLogger(__name__)
DEFAULT_SESSIONS = 7  # NVDEC engines on an H100/H200 (A100: 5); one session keeps one engine busy
FIRST_GPU = "first_gpu"  # NvdecDecoder's output_device by default: the first of its gpu_ids
FALLBACKS_KEPT = 100  # NvdecDecoder.fallbacks: the latest videos sent to the CPU, with their reasons
FORMATS_KEPT = 2  # decoder sessions per thread, one per stream format (codec, size, pixel format)


class NvdecError(RuntimeError):
    """NVDEC failed on a stream, or did not return a sampled frame; the rest of the video goes to the CPU."""


class NvdecDecoder:
    """FrameDecoder on NVDEC: GOP tasks of each video spread over long-lived sessions on the GPUs `gpu_ids`.

    `gpu_ids`: the GPUs that decode (an int: that GPU alone). `sessions_per_gpu`: sessions (threads) on each,
    default each GPU's NVDEC engine count (`GetDecoderCaps`), else 7; `sessions` is their total. Thread k, in the
    order threads are made, serves GPU `session_gpus[k]` (k mod N for equal counts) with its own session, and
    every thread takes the next task from one shared queue. Tasks are planned for `sessions` decoders.
    `helper_processes`: every GPU but the output device's (the first when frames stay where decoded) decodes in
    helper processes (`nvdec_remote`), its threads here passing them tasks (one process feeding several GPUs is
    bound by its GIL); `processes_per_gpu` (default 1) splits each GPU's sessions over that many processes,
    the output device's first share staying in this process (`bench/RESULTS.md`, "NVDEC, 10-minute video"). A
    helper that cannot start leaves its sessions to threads here (logged), one that dies is restarted for the next
    task.
    Frames are 3xHxW uint8 RGB tensors on `output_device` (default the first of `gpu_ids`: where the encoder
    runs; None: left on the GPU that decoded each, CPU fallbacks on the first GPU), peer-copied there by the
    decoding thread, which waits for the copy before handing the frames over. They are turned upright by the
    stream's rotation: the same frames, count and size as `CpuDecoder`, with pixels within the
    colour-conversion tolerance of tests/gpu/test_nvdec.py, whichever GPU decoded them.
    At most `window` tasks (default 2 per session) are decoded ahead of the consumer, which bounds GPU memory.
    Videos NVDEC should not decode on every one of the GPUs (`unsupported_reason`) go to `fallback` (default
    `CpuDecoder()`), as do the rest of a video's frames when NVDEC fails on it; `fallbacks` holds the latest
    (source, reason) pairs and `paths.fallbacks()` counts them per reason. Raises NvdecUnavailable when
    PyNvVideoCodec or a GPU is missing, ValueError for an empty or repeated `gpu_ids`, `sessions_per_gpu` < 1, or
    `processes_per_gpu` < 1 (or > 1 without `helper_processes`).
    """

    path = "nvdec"

    def __init__(self, gpu_ids: int | Sequence[int] = 0, sessions_per_gpu: int | None = None,
                 max_gop_size: int = MAX_GOP_SIZE, fallback: FrameDecoder | None = None,
                 paths: DecodePaths | None = None, window: int | None = None,
                 output_device: torch.device | str | None = FIRST_GPU, helper_processes: bool = False,
                 processes_per_gpu: int = 1):
        ids = (gpu_ids,) if isinstance(gpu_ids, int) else tuple(gpu_ids)
        if not ids or len(set(ids)) != len(ids) or (sessions_per_gpu is not None and sessions_per_gpu < 1):
            raise ValueError(f"gpu_ids must be distinct and at least one, sessions_per_gpu >= 1; got {gpu_ids!r}, "
                             f"{sessions_per_gpu!r}")
        if processes_per_gpu < 1 or (processes_per_gpu > 1 and not helper_processes):
            raise ValueError(f"processes_per_gpu must be >= 1, and 1 without helper_processes; got {processes_per_gpu}")
        self.nvc, self.gpu_ids = load_pynvvideocodec(ids), ids
        self.output_device = self._output(output_device)
        self._lock = threading.Lock()
        self.caps = DecoderCaps(self.nvc)
        engines = {}
        for gpu in ids:
            caps, error = self._caps("h264", "yuv420p", 8, gpu)
            if error:
                log.warning("NVDEC capability query failed on GPU %d: %s", gpu, error)
            engines[gpu] = sessions_per_gpu or (caps or {}).get("num_decoder_engines") or DEFAULT_SESSIONS
        self.session_gpus = interleave(engines)
        self.session_procs = session_processes(self.session_gpus, processes_per_gpu)
        self.sessions = len(self.session_gpus)
        self.max_gop_size, self.window = max_gop_size, window or 2 * self.sessions
        self.fallback, self.paths = fallback or CpuDecoder(), paths or DecodePaths()
        self.fallbacks: deque[tuple[str, str]] = deque(maxlen=FALLBACKS_KEPT)
        self._threads = 0  # threads made so far: the next one serves session_gpus[_threads]
        self._local = threading.local()  # this thread's GPU, its decoder sessions by format, its open files
        self._stats: dict[str, SessionStats] = {}
        # its one work queue is the shared queue: whichever session is free, on any GPU, takes the next task
        self._executor = ThreadPoolExecutor(self.sessions, thread_name_prefix="nvdec", initializer=self._bind_thread)
        self._helpers: dict[tuple[int, int], NvdecHelper | None] = {}  # (GPU, process) -> its helper
        self._restart_lock = threading.Lock()  # one helper restart at a time, outside `_lock`
        self._closing = False
        out = self.output_device
        home = out.index if out is not None and out.type == "cuda" else ids[0]
        for key in dict.fromkeys(zip(self.session_gpus, self.session_procs)) if helper_processes else ():
            if key != (home, 0):  # the GPU frames end on decodes its first share here: no copy between processes
                self._helpers[key] = self._start_helper(key)

    def _start_helper(self, key: tuple[int, int]) -> NvdecHelper | None:
        """The helper for the sessions of (GPU, process) `key`; None (logged) when it cannot start."""
        sessions = sum(slot == key for slot in zip(self.session_gpus, self.session_procs))
        try:
            return NvdecHelper(key[0], sessions, self.max_gop_size)
        except HelperError as exc:
            log.warning("%s; its %d sessions on GPU %d decode in this process", exc, sessions, key[0])
            return None

    def _output(self, output_device: torch.device | str | None) -> torch.device | None:
        if output_device is None:
            return None
        if isinstance(output_device, str) and output_device == FIRST_GPU:
            return torch.device("cuda", self.gpu_ids[0])
        device = torch.device(output_device)
        if device.type == "cuda":
            device = torch.device("cuda", device.index or 0)
            if device.index >= torch.cuda.device_count():
                raise NvdecUnavailable(f"no CUDA GPU {device.index} to put the frames on")
        return device

    def close(self) -> None:
        self._closing = True  # no helper restarts; closing the helpers first fails their tasks in flight at once
        with self._restart_lock:
            for helper in self._helpers.values():
                if helper is not None:
                    helper.close()
        self._executor.shutdown(wait=True, cancel_futures=True)
        close = getattr(self.fallback, "close", None)
        if close is not None:
            close()

    def session_stats(self) -> list[SessionStats]:
        """Per session (thread) that has run a task: its `SessionStats`."""
        with self._lock:
            return list(self._stats.values())

    def _bind_thread(self) -> None:
        """The executor's thread initializer: the k-th thread made serves GPU `session_gpus[k]` for its life."""
        with self._lock:
            k, self._threads = self._threads, self._threads + 1
        self._local.gpu, self._local.proc = self.session_gpus[k], self.session_procs[k]
        threading.current_thread().name = f"nvdec-gpu{self._local.gpu}-{k}"

    def _caps(self, codec: str, pix_fmt: str, bit_depth: int, gpu: int | None = None) -> tuple[dict | None, str]:
        """`DecoderCaps.query` on `gpu`, default the first: (the answer, "") or (None, why the query failed)."""
        return self.caps.query(self.gpu_ids[0] if gpu is None else gpu, codec, pix_fmt, bit_depth)

    def why_not(self, bmap: BitstreamMap) -> str:
        """`unsupported_reason` for `bmap` on these GPUs ("" when NVDEC should decode it): the reason of the first
        GPU that refuses it, since a session on any of them may get any of its tasks."""
        return self.caps.why_not(bmap, self.gpu_ids)

    def decode(self, source: Source, frame_indices: Sequence[int]) -> Iterator[torch.Tensor]:
        indices, bmap = map_for_indices(source, frame_indices)
        if bmap is None:
            return
        reason = self.why_not(bmap)
        if reason:
            yield from self._fall_back(source, indices, reason)
            return
        self.paths.count(self.path)
        tasks = plan_gop_tasks(bmap, indices, self.max_gop_size, self.sessions)
        done = 0
        with as_file(source) as path:
            try:
                for frame in frames_in_order(tasks, indices, lambda t: self._submit(path, bmap, t), self.window):
                    yield frame
                    done += 1
            except NvdecError as exc:
                yield from self._fall_back(source, indices[done:], "NVDEC failed during decoding", str(exc))

    def _fall_back(self, source: Source, indices: list[int], reason: str, detail: str = "") -> Iterator[torch.Tensor]:
        """`fallback`'s frames as tensors on the output device (else the first GPU); it counts its own path when it
        shares `paths`."""
        name = f"<{len(source)} bytes>" if isinstance(source, bytes) else str(source)
        self.fallbacks.append((name, f"{reason}: {detail}" if detail else reason))
        self.paths.fallback(getattr(self.fallback, "path", "cpu"), reason, f"{detail}; {name}" if detail else name)
        device = self.output_device or torch.device("cuda", self.gpu_ids[0])
        for frame in self.fallback.decode(source, indices):
            yield torch.from_numpy(frame).permute(2, 0, 1).to(device, non_blocking=True)

    def _submit(self, path: str, bmap: BitstreamMap, task: DecodeTask) -> list[Future]:
        futures = [Future() for _ in task.parts]
        self.run_job_later(path, StreamFormat.of(bmap), GopJob.of(bmap, task), futures)
        return futures

    def run_job_later(self, path: str, fmt: StreamFormat, job: GopJob, futures: list[Future]) -> Future:
        """Queue `job` of the video file at `path` for the next free session: part p's frames go into
        `futures[p]` (NvdecError when NVDEC failed). Returns a future of the packets fed to NVDEC."""
        return self._executor.submit(self._run_task, path, fmt, job, futures)

    def _session(self, fmt: StreamFormat):
        """This thread's decoder session for stream format `fmt`, on this thread's GPU; sessions are kept per
        format (at most FORMATS_KEPT, least recently used dropped), so a thread alternating between two videos
        does not rebuild its session each time."""
        sessions = self._local.__dict__.setdefault("sessions", OrderedDict())
        key = (fmt.codec, fmt.coded_width, fmt.coded_height, fmt.pix_fmt)
        session = sessions.pop(key, None)
        if session is None:
            nvc = self.nvc
            session = nvc.CreateDecoder(gpuid=self._local.gpu, codec=getattr(nvc.cudaVideoCodec, CODECS[fmt.codec]),
                                        usedevicememory=True, outputColorType=nvc.OutputColorType.NATIVE)
        sessions[key] = session  # put back only once made: a session that failed is rebuilt
        while len(sessions) > FORMATS_KEPT:
            sessions.popitem(last=False)
        return session

    def _run_task(self, path: str, fmt: StreamFormat, job: GopJob, futures: list[Future]) -> int:
        """One task on this thread's session, or its helper process's: each part's frames into its future, in
        order. Returns the packets fed to NVDEC."""
        if not any([f.set_running_or_notify_cancel() for f in futures]):
            return 0  # its video's consumer has gone
        start, fed, gpu = time.perf_counter(), 0, self._local.gpu
        try:
            helper = self._helper((gpu, self._local.proc))
            fed = self._decode(path, fmt, job, futures) if helper is None else helper.run(
                path, fmt, job, futures, self.output_device)
            why = "the helper process sent no frames for it"
        except Exception as exc:  # from the helper (`_decode` settles its own failures)
            why = f"{type(exc).__name__}: {exc}"
        for part, future in enumerate(futures):  # never left unsettled: its consumer waits on it
            if not future.done():
                try:
                    future.set_exception(NvdecError(f"NVDEC on GPU {gpu}, part {part}: {why}"))
                except InvalidStateError:
                    pass
        frames = sum(len(f.result()) for f in futures if not f.cancelled() and f.exception() is None)
        name = threading.current_thread().name
        with self._lock:
            old = self._stats.get(name, SessionStats(gpu, 0, 0, 0, 0.0))
            self._stats[name] = SessionStats(old.gpu, old.tasks + 1, old.frames + frames, old.packets + fed,
                                             old.busy_s + time.perf_counter() - start)
        return fed

    def _helper(self, key: tuple[int, int]) -> NvdecHelper | None:
        """The helper process of (GPU, process) `key` (restarted once it has exited), None where this process
        decodes."""
        helper = self._helpers.get(key)
        if helper is None or helper.alive:
            return helper
        with self._restart_lock:
            if self._closing:
                raise HelperError("the decoder is closing")
            if self._helpers[key] is helper:
                helper.close()
                self._helpers[key] = self._start_helper(key)
            return self._helpers[key]

    def _decode(self, path: str, fmt: StreamFormat, job: GopJob, futures: list[Future]) -> int:
        """`_run_task` on this thread's own session; NVDEC errors fail the futures not yet set."""
        part, fed = 0, 0
        readers = self._local.__dict__.setdefault("readers", ReaderCache())
        try:
            reader = readers.get(path)
            packets = NvdecPackets(self.nvc, self._session(fmt), reader.stream, fmt.rotation // 90, self.output_device)
            for part, out in enumerate(reader.run(job, packets)):
                if any(frame is None for frame in out):
                    raise NvdecError(f"NVDEC returned no frame for some of {job.task.parts[part].frames[:4]}...")
                synchronize(packets.decoded_on | {out[0].device})
                futures[part].set_result(out)
            fed = packets.fed
        except Exception as exc:
            # in an unknown state: the next task builds anew
            self._local.__dict__.pop("sessions", None)
            readers.clear()
            error = exc if isinstance(exc, NvdecError) else NvdecError(f"NVDEC: {type(exc).__name__}: {exc}")
            for future in futures[part:]:
                if not future.done():
                    future.set_exception(error)
        return fed
