"""NVDEC decoding through PyNvVideoCodec 2.x: one video's GOP tasks on a pool of long-lived decoder sessions.

Imports without PyNvVideoCodec or a GPU (the library is imported when a decoder is built). Each session is a
`SimpleDecoder` (RGB planar output in GPU memory) owned by one thread; a free session takes the next GOP task
(`gop_plan`) of any video, and frames stream back in order (`gop_plan.frames_in_order`). Each GOP is entered at
its keyframe, so SimpleDecoder's seek lands on it and its frame count starts there. `unsupported_reason` sends
to the CPU decoder given as `fallback`: streams NVDEC cannot take (codec, chroma format, bit depth or size
outside `GetDecoderCaps`, e.g. 4:4:4 H.264 or AV1 on H100/H200), open GOPs and uneven frame timing (SimpleDecoder
addresses frames by index); so do NVDEC errors, including a returned frame whose PTS is not the one asked for.
Every fallback is logged at WARNING with its reason, kept in `NvdecDecoder.fallbacks` and counted per reason in
`DecodePaths`; the video is counted under the path that decoded it.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from flashcodec.decoders import CpuDecoder, DecodePaths, FrameDecoder
from flashcodec.gop import BitstreamMap, map_for_indices
from flashcodec.gop_plan import MAX_GOP_SIZE, DecodeTask, frames_in_order, plan_gop_tasks
from flashcodec.parallel import as_file
from flashcodec.probe import Source, open_container

log = logging.getLogger(__name__)
DEFAULT_SESSIONS = 7  # NVDEC engines on an H100/H200 (A100: 5); one session keeps one engine busy
FALLBACKS_KEPT = 100  # NvdecDecoder.fallbacks: the latest videos sent to the CPU, with their reasons
# Member names of PyNvVideoCodec's pybind11 enums (PyNvDecoder.cpp `ENUM_VALUE(cudaVideoChromaFormat, 420)`;
# its samples compare `str(ChromaFormat())` with "cudaVideoChromaFormat.420"): not the C names' YUV420.
CODECS = {"h264": "H264", "hevc": "HEVC", "vp9": "VP9", "av1": "AV1"}  # FFmpeg name -> cudaVideoCodec member
CHROMA = {"420": "420", "422": "422", "444": "444", "gray": "Monochrome"}  # _chroma() -> cudaVideoChromaFormat


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


def unsupported_reason(bmap: BitstreamMap, caps: dict | None, caps_error: str = "") -> str:
    """Why NVDEC should not decode `bmap`'s stream ("" if it should); a stable phrase (counted per reason).

    `caps`: `GetDecoderCaps` for its codec, chroma format and bit depth (keys `supported`, `width_min/max`,
    `height_min/max`, `mb_num_max`: 16x16 macroblocks); `caps_error`: why that query failed, if it did.
    """
    info = bmap.info
    fmt = f"{info.codec} {bmap.pix_fmt}"
    if not bmap.exact_timestamps:
        return "packets without unique timestamps"
    if info.codec not in CODECS:
        return f"codec {info.codec} is not one FlashCodec decodes on NVDEC"
    if caps_error or not caps:
        return f"the NVDEC capability query for {fmt} failed: {caps_error or 'no answer'}"
    if not caps.get("supported", 1) or caps.get("width_max", 0) <= 0:
        return f"this GPU's NVDEC does not decode {fmt}"
    w, h = info.coded_width, info.coded_height
    if not (caps.get("width_min", 0) <= w <= caps["width_max"] and caps.get("height_min", 0) <= h <= caps.get(
            "height_max", 0)) or -(-w // 16) * -(-h // 16) > caps.get("mb_num_max", 1 << 31):
        return (f"{fmt} size outside this GPU's NVDEC limits ({caps.get('width_min', 0)}x{caps.get('height_min', 0)}"
                f" to {caps['width_max']}x{caps.get('height_max', 0)}, {caps.get('mb_num_max')} macroblocks)")
    if any(g.open for g in bmap.gops):
        # after a seek SimpleDecoder drops the leading frames and counts from the keyframe's decode-order index,
        # so every frame of an open GOP comes back shifted (PyNvVideoCodec SeekUtils::GetFramesByIdxList)
        return "open GOPs (SimpleDecoder's frame indices are shifted after a seek into one)"
    ticks = sorted(bmap.packet_pts)
    steps = [b - a for a, b in zip(ticks, ticks[1:])] or [0]
    if max(steps) - min(steps) > 1:  # one tick of rounding (30 fps in milliseconds) still rounds to the frame
        return "frame timing is uneven (SimpleDecoder addresses frames by time x rate)"
    return ""


def _file_key(path: str) -> tuple:
    """What tells a file apart from an earlier one at the same path (a session must reopen a changed file)."""
    st = os.stat(path)
    return path, st.st_ino, st.st_size, st.st_mtime_ns


def _needs_scan(path: str) -> bool:
    """Whether the container states no frame count (WebM/MKV): SimpleDecoder must then count the packets
    (`need_scanned_stream_metadata`), or it takes the file for an elementary stream and refuses it."""
    with open_container(path) as container:
        return not container.streams.video[0].frames


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
    Videos NVDEC should not decode (`unsupported_reason`) go to `fallback` (default `CpuDecoder()`), as do the
    rest of a video's frames when NVDEC fails on it; `fallbacks` holds the latest (source, reason) pairs and
    `paths.fallbacks()` counts them per reason. Raises NvdecUnavailable when PyNvVideoCodec or the GPU is missing.
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
        self._lock = threading.Lock()
        self._caps_cache: dict[tuple[str, str, int], tuple[dict | None, str]] = {}
        caps, error = self._caps("h264", "yuv420p", 8)
        if error:
            log.warning("NVDEC capability query failed on GPU %d: %s", gpu_id, error)
        self.sessions = sessions or (caps or {}).get("num_decoder_engines") or DEFAULT_SESSIONS
        self.max_gop_size, self.window = max_gop_size, window or 2 * self.sessions
        self.fallback, self.paths = fallback or CpuDecoder(), paths or DecodePaths()
        self.fallbacks: deque[tuple[str, str]] = deque(maxlen=FALLBACKS_KEPT)
        self._executor = ThreadPoolExecutor(self.sessions, thread_name_prefix="nvdec")
        self._local = threading.local()  # this thread's sessions: need_scanned_stream_metadata -> (decoder, file)
        self._stats: dict[str, SessionStats] = {}

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        close = getattr(self.fallback, "close", None)
        if close is not None:
            close()

    def session_stats(self) -> list[SessionStats]:
        """Per session (thread) that has run a task: its `SessionStats`."""
        with self._lock:
            return list(self._stats.values())

    def _caps(self, codec: str, pix_fmt: str, bit_depth: int) -> tuple[dict | None, str]:
        """(`GetDecoderCaps` answer, "") or (None, why the query failed); cached, since each query creates and
        destroys a CUDA context (PyNvDecoder.cpp `PyNvDecoderCaps`)."""
        key = (codec, _chroma(pix_fmt), bit_depth)
        with self._lock:
            if key in self._caps_cache:
                return self._caps_cache[key]
        nvc = self.nvc
        try:
            answer = (dict(nvc.GetDecoderCaps(
                gpuid=self.gpu_id, codec=getattr(nvc.cudaVideoCodec, CODECS[codec]),
                chromaformat=getattr(nvc.cudaVideoChromaFormat, CHROMA[key[1]]), bitdepth=bit_depth)), "")
        except Exception as exc:  # an enum this build lacks, or the driver refusing the query
            answer = (None, f"{type(exc).__name__}: {exc}")
        with self._lock:
            self._caps_cache[key] = answer
        return answer

    def why_not(self, bmap: BitstreamMap) -> str:
        """`unsupported_reason` for `bmap` on this GPU ("" when NVDEC should decode it)."""
        if bmap.info.codec not in CODECS:
            return unsupported_reason(bmap, None)
        return unsupported_reason(bmap, *self._caps(bmap.info.codec, bmap.pix_fmt, bmap.bit_depth))

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
            scan = _needs_scan(path)
            try:
                for frame in frames_in_order(tasks, indices, lambda t: self._submit(path, scan, bmap, t), self.window):
                    yield frame
                    done += 1
            except NvdecError as exc:
                yield from self._fall_back(source, indices[done:], "NVDEC failed during decoding", str(exc))

    def _fall_back(self, source: Source, indices: list[int], reason: str, detail: str = "") -> Iterator[torch.Tensor]:
        """`fallback`'s frames as tensors on this GPU (it counts its own path when it shares `paths`)."""
        name = f"<{len(source)} bytes>" if isinstance(source, bytes) else str(source)
        self.fallbacks.append((name, f"{reason}: {detail}" if detail else reason))
        self.paths.fallback(getattr(self.fallback, "path", "cpu"), reason, f"{detail}; {name}" if detail else name)
        for frame in self.fallback.decode(source, indices):
            yield torch.from_numpy(frame).permute(2, 0, 1).to(self.device, non_blocking=True)

    def _submit(self, path: str, scan: bool, bmap: BitstreamMap, task: DecodeTask) -> list[Future]:
        futures = [Future() for _ in task.parts]
        self._executor.submit(self._run, path, scan, bmap, task, futures)
        return futures

    def _session(self, path: str, scan: bool):
        """This thread's SimpleDecoder set to `path` (reconfigured when it held another file)."""
        sessions = getattr(self._local, "sessions", None)
        if sessions is None:
            sessions = self._local.sessions = {}
        decoder, held = sessions.pop(scan, (None, None))
        key = _file_key(path)
        if decoder is None:
            decoder = self.nvc.SimpleDecoder(path, gpu_id=self.gpu_id, use_device_memory=True,
                                             need_scanned_stream_metadata=scan,
                                             output_color_type=self.nvc.OutputColorType.RGBP)
        elif held != key:
            decoder.reconfigure_decoder(path)  # reuses the session's NVDEC decoder when the format allows
        sessions[scan] = (decoder, key)  # put back only once set up: a session that failed is rebuilt
        return decoder

    def _run(self, path: str, scan: bool, bmap: BitstreamMap, task: DecodeTask, futures: list[Future]) -> None:
        """One task on this thread's session: each part's frames into its future, in order."""
        if not any([f.set_running_or_notify_cancel() for f in futures]):
            return  # its video's consumer has gone
        start, frames, part = time.perf_counter(), 0, 0
        clockwise = bmap.info.rotation // 90
        entered: set[int] = set()  # keyframes (presentation indices) of the GOPs this task has started
        try:
            decoder = self._session(path, scan)
            if len(decoder) != bmap.info.num_frames:  # its indices would not be ours
                raise NvdecError(f"SimpleDecoder counts {len(decoder)} frames, the GOP map {bmap.info.num_frames}")
            for part, future in enumerate(futures):
                wanted = task.parts[part].frames
                keys = {bmap.gop_of_frame(f).key_frame for f in wanted} - entered
                entered |= keys
                asked = sorted(set(wanted) | keys)
                decoded = list(decoder.get_batch_frames_by_index(asked))
                if len(decoded) != len(asked):
                    raise NvdecError(f"NVDEC returned {len(decoded)} of {len(asked)} frames")
                for frame, index in zip(decoded, asked):
                    expected = bmap.packet_pts[bmap.frame_packet[index]]
                    if frame.getPTS() != expected:
                        raise NvdecError(f"NVDEC returned PTS {frame.getPTS()} for frame {index} (PTS {expected})")
                by_index = dict(zip(asked, decoded))
                out = []
                for index in wanted:
                    rgb = torch.from_dlpack(by_index[index]).clone()  # the session reuses its surfaces next call
                    out.append(torch.rot90(rgb, k=-clockwise, dims=(1, 2)).contiguous() if clockwise else rgb)
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()  # the consumer is another thread
                frames += len(out)
                future.set_result(out)
        except Exception as exc:
            getattr(self._local, "sessions", {}).pop(scan, None)  # in an unknown state: the next task builds anew
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
