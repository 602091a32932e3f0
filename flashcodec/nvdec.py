"""NVDEC decoding through PyNvVideoCodec 2.x: one video's GOP tasks on a pool of long-lived decoder sessions.

Imports without PyNvVideoCodec or a GPU (the library is imported when a decoder is built). Each session is a
`SimpleDecoder` (RGB planar output in GPU memory) owned by one thread; a free session takes the next GOP task
(`gop_plan`) of any video, and frames stream back in order (`gop_plan.frames_in_order`). Streams NVDEC cannot
take (codec, chroma format, bit depth or size outside `GetDecoderCaps`, e.g. 4:4:4 H.264 or AV1 on H100/H200),
streams with uneven frame timing (SimpleDecoder addresses frames by index = time x rate), and any NVDEC error,
including a returned frame whose PTS is not the one asked for, go to the CPU decoder given as `fallback`;
each such video is logged with its reason and counted under the path that decoded it.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from flashcodec.decoders import CpuDecoder, DecodePaths, FrameDecoder
from flashcodec.gop import BitstreamMap, map_for_indices
from flashcodec.gop_plan import MAX_GOP_SIZE, DecodeTask, frames_in_order, plan_gop_tasks
from flashcodec.parallel import as_file
from flashcodec.probe import Source

log = logging.getLogger(__name__)
DEFAULT_SESSIONS = 7  # NVDEC engines on an H100/H200 (A100: 5); one session keeps one engine busy
CODECS = {"h264": "H264", "hevc": "HEVC", "vp9": "VP9", "av1": "AV1"}  # FFmpeg name -> cudaVideoCodec member
CHROMA = {"420": "YUV420", "422": "YUV422", "444": "YUV444", "gray": "Monochrome"}


class NvdecUnavailable(RuntimeError):
    """PyNvVideoCodec cannot be imported, or there is no CUDA GPU for it."""


class NvdecError(RuntimeError):
    """NVDEC failed on a stream, or returned a frame other than the one asked for; the video goes to the CPU."""


def _chroma(pix_fmt: str) -> str:
    """FFmpeg pixel format -> key of CHROMA ("yuv444p10le" -> "444", "gbrp" -> "444", "nv12" -> "420")."""
    if pix_fmt.startswith("gray"):
        return "gray"
    if "444" in pix_fmt or pix_fmt.startswith("gbr"):
        return "444"
    return "422" if "422" in pix_fmt else "420"


def unsupported_reason(bmap: BitstreamMap, caps: dict | None) -> str:
    """Why NVDEC should not decode `bmap`'s stream ("" if it should). `caps`: `GetDecoderCaps` for its codec,
    chroma format and bit depth (None if the query failed); an unsupported combination gives no size limits."""
    info = bmap.info
    if not bmap.exact_timestamps:
        return "packets without unique timestamps"
    if info.codec not in CODECS:
        return f"codec {info.codec} is not decoded by NVDEC"
    if not caps or caps.get("width_max", 0) < info.coded_width or caps.get("height_max", 0) < info.coded_height:
        return f"this GPU's NVDEC does not take {info.codec} {bmap.pix_fmt} at {info.coded_width}x{info.coded_height}"
    ticks = sorted(bmap.packet_pts)
    steps = [b - a for a, b in zip(ticks, ticks[1:])] or [0]
    if max(steps) - min(steps) > 1:  # one tick of rounding (30 fps in milliseconds) still rounds to the frame
        return "frame timing is uneven (SimpleDecoder addresses frames by time x rate)"
    return ""


@dataclass(frozen=True)
class SessionStats:
    """One NVDEC session's work so far: tasks run, frames returned, packets its tasks cover (about the frames
    NVDEC decoded), seconds busy (wall clock)."""

    tasks: int
    frames: int
    packets: int
    busy_s: float


class NvdecDecoder:
    """FrameDecoder on NVDEC: GOP tasks of each video spread over `sessions` long-lived sessions on GPU `gpu_id`.

    Frames are 3xHxW uint8 RGB tensors on `cuda:gpu_id`, turned upright by the stream's rotation; the same
    frames, count and size as `CpuDecoder`, with pixels within the colour-conversion tolerance of
    tests/gpu/test_nvdec.py. `sessions` defaults to the GPU's NVDEC engine count (`GetDecoderCaps`), else 7.
    At most `window` tasks (default 2 per session) are decoded ahead of the consumer, which bounds GPU memory.
    Videos NVDEC cannot decode go to `fallback` (default `CpuDecoder()`), as do the rest of a video's frames
    when NVDEC fails on it. Raises NvdecUnavailable when PyNvVideoCodec or the GPU is missing.
    """

    path = "nvdec"

    def __init__(self, gpu_id: int = 0, sessions: int | None = None, max_gop_size: int = MAX_GOP_SIZE,
                 fallback: FrameDecoder | None = None, paths: DecodePaths | None = None, window: int | None = None):
        try:
            import PyNvVideoCodec as nvc
        except Exception as exc:  # ImportError, or its CUDA libraries failing to load
            raise NvdecUnavailable(f"PyNvVideoCodec: {type(exc).__name__}: {exc}") from exc
        if not torch.cuda.is_available() or gpu_id >= torch.cuda.device_count():
            raise NvdecUnavailable(f"no CUDA GPU {gpu_id}")
        self.nvc, self.gpu_id, self.device = nvc, gpu_id, torch.device("cuda", gpu_id)
        engines = (self._caps("h264", "yuv420p", 8) or {}).get("num_decoder_engines")
        self.sessions = sessions or engines or DEFAULT_SESSIONS
        self.max_gop_size, self.window = max_gop_size, window or 2 * self.sessions
        self.fallback, self.paths = fallback or CpuDecoder(), paths or DecodePaths()
        self._executor = ThreadPoolExecutor(self.sessions, thread_name_prefix="nvdec")
        self._local = threading.local()  # this thread's session: a SimpleDecoder and the path it is set to
        self._stats: dict[str, SessionStats] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        close = getattr(self.fallback, "close", None)
        if close is not None:
            close()

    def session_stats(self) -> list[SessionStats]:
        """Per session (thread) that has run a task: its `SessionStats`."""
        with self._lock:
            return list(self._stats.values())

    def _caps(self, codec: str, pix_fmt: str, bit_depth: int) -> dict | None:
        nvc = self.nvc
        try:
            return dict(nvc.GetDecoderCaps(
                gpuid=self.gpu_id, codec=getattr(nvc.cudaVideoCodec, CODECS[codec]),
                chromaformat=getattr(nvc.cudaVideoChromaFormat, CHROMA[_chroma(pix_fmt)]), bitdepth=bit_depth))
        except Exception:  # an enum this build lacks, or the driver refusing the query: not supported
            return None

    def decode(self, source: Source, frame_indices: Sequence[int]) -> Iterator[torch.Tensor]:
        indices, bmap = map_for_indices(source, frame_indices)
        if bmap is None:
            return
        caps = self._caps(bmap.info.codec, bmap.pix_fmt, bmap.bit_depth) if bmap.info.codec in CODECS else None
        reason = unsupported_reason(bmap, caps)
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
                yield from self._fall_back(source, indices[done:], str(exc))

    def _fall_back(self, source: Source, indices: list[int], reason: str) -> Iterator[torch.Tensor]:
        """`fallback`'s frames as tensors on this GPU (it counts its own path when it shares `paths`)."""
        log.info("video goes from NVDEC to the %s path: %s", getattr(self.fallback, "path", "cpu"), reason)
        for frame in self.fallback.decode(source, indices):
            yield torch.from_numpy(frame).permute(2, 0, 1).to(self.device, non_blocking=True)

    def _submit(self, path: str, bmap: BitstreamMap, task: DecodeTask) -> list[Future]:
        futures = [Future() for _ in task.parts]
        self._executor.submit(self._run, path, bmap, task, futures)
        return futures

    def _session(self, path: str):
        local = self._local
        if getattr(local, "decoder", None) is None:
            local.decoder = self.nvc.SimpleDecoder(path, gpu_id=self.gpu_id, use_device_memory=True,
                                                   output_color_type=self.nvc.OutputColorType.RGBP)
        elif local.path != path:
            local.decoder.reconfigure_decoder(path)  # reuses the session's NVDEC decoder when the format allows
        local.path = path
        return local.decoder

    def _run(self, path: str, bmap: BitstreamMap, task: DecodeTask, futures: list[Future]) -> None:
        """One task on this thread's session: each part's frames into its future, in order."""
        if not any([f.set_running_or_notify_cancel() for f in futures]):
            return  # its video's consumer has gone
        start, frames, part = time.perf_counter(), 0, 0
        clockwise = bmap.info.rotation // 90
        try:
            decoder = self._session(path)
            for part, future in enumerate(futures):
                wanted = task.parts[part].frames
                decoded = decoder.get_batch_frames_by_index(list(wanted))
                out = []
                for frame, index in zip(decoded, wanted):
                    expected = bmap.packet_pts[bmap.frame_packet[index]]
                    if frame.getPTS() != expected:
                        raise NvdecError(f"NVDEC returned PTS {frame.getPTS()} for frame {index} (PTS {expected})")
                    # clone: the session reuses its output surfaces on the next call
                    rgb = torch.from_dlpack(frame).clone()
                    out.append(torch.rot90(rgb, k=-clockwise, dims=(1, 2)).contiguous() if clockwise else rgb)
                if len(out) != len(wanted):
                    raise NvdecError(f"NVDEC returned {len(out)} of {len(wanted)} frames")
                torch.cuda.current_stream(self.device).synchronize()  # the consumer is another thread
                frames += len(out)
                future.set_result(out)
        except Exception as exc:
            self._local.decoder = None  # a session in an unknown state: the next task builds a new one
            error = exc if isinstance(exc, NvdecError) else NvdecError(f"NVDEC: {type(exc).__name__}: {exc}")
            for future in futures[part:]:
                if not future.done():
                    future.set_exception(error)
        finally:
            name = threading.current_thread().name
            with self._lock:
                old = self._stats.get(name, SessionStats(0, 0, 0, 0.0))
                self._stats[name] = SessionStats(old.tasks + 1, old.frames + frames, old.packets + task.num_packets,
                                                 old.busy_s + time.perf_counter() - start)
