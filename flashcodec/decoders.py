"""Frame decoders: sampled frame indices in, upright RGB frames out.

`FrameDecoder` is the contract; `CpuDecoder` decodes sequentially with PyAV/FFmpeg (the reference); the
GOP-parallel decoders are `flashcodec.parallel` (CPU) and `flashcodec.nvdec`. `DecodePaths` counts which
decoder path served each video, and why a video fell back to a slower one.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Protocol, Sequence

import av
import numpy as np

from flashcodec.errors import MediaError
from flashcodec.probe import Source, clockwise_turn, open_container, read_packets, unwrapped_pts

log = logging.getLogger(__name__)


class FrameDecoder(Protocol):
    def decode(self, source: Source, frame_indices: Sequence[int]) -> Iterator[np.ndarray]:
        """Yield one frame per entry of `frame_indices`, in that order.

        `frame_indices`: presentation-order indices into the video (those of `VideoInfo.frame_pts_s`),
        non-decreasing; a repeated index yields the same frame again. Each frame is an HxWx3 uint8 RGB array,
        turned upright by the stream's display rotation (H, W = `VideoInfo.height`, `.width`); a GPU decoder
        yields 3xHxW uint8 torch tensors on its device instead (RGB planar). Damaged input:
        a frame that cannot be decoded is replaced by the nearest decoded frame before it (after it if there is
        none before); MediaError if no frame decodes. Raises ValueError for indices that are negative or not
        non-decreasing, MediaError for indices past the last frame. Never blocks on input: work is bounded by
        the number of packets.
        """
        ...


PATHS = ("nvdec", "cpu_parallel", "cpu")  # the decode paths a video may take (`FrameDecoder.path`)


class DecodePaths:
    """Thread-safe counts of videos per decode path (one of :data:`PATHS`, exposed as a metric), and of
    fallbacks: videos decoded on a slower path than the decoder chosen for them, per (path, reason).

    `count(path)` counts the path that decoded a video (logged at DEBUG); `count(path, reason)` also records it
    as a fallback to `path`. `fallback(path, reason, detail)` records a fallback without counting a path, for a
    decoder that hands the video to another one which counts its own path. Every fallback is logged at WARNING
    with its reason and `detail` (this video's specifics, not part of the counted key: keep `reason` a stable
    phrase so the keys stay few).
    """

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._fallbacks: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()

    def count(self, path: str, reason: str = "") -> None:
        with self._lock:
            self._counts[path] += 1
        if reason:
            self.fallback(path, reason)
        else:
            log.debug("video decoded on the %s path", path)

    def fallback(self, path: str, reason: str, detail: str = "") -> None:
        with self._lock:
            self._fallbacks[(path, reason)] += 1
        log.warning("video decoded on the %s path instead: %s%s", path, reason, f" ({detail})" if detail else "")

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def fallbacks(self) -> dict[tuple[str, str], int]:
        """(path the video went to, reason) -> videos so far."""
        with self._lock:
            return dict(self._fallbacks)


def check_indices(indices: Sequence[int]) -> None:
    """Raise ValueError unless `indices` are non-negative and non-decreasing (the FrameDecoder contract)."""
    if indices and (indices[0] < 0 or any(b < a for a, b in zip(indices, indices[1:]))):
        raise ValueError(f"frame_indices must be non-negative and non-decreasing, got {list(indices[:8])}...")


def upright_rgb(frame: av.VideoFrame) -> np.ndarray:
    """A decoded frame as HxWx3 uint8 RGB, turned upright by its display rotation."""
    rgb = frame.to_ndarray(format="rgb24")
    clockwise = clockwise_turn(frame) // 90
    return np.ascontiguousarray(np.rot90(rgb, k=-clockwise)) if clockwise else rgb


def _needed_packets(packets: list[av.Packet], targets: set[int]) -> list[av.Packet]:
    """The packets of every GOP that holds a target PTS, each preceded by its previous GOP, up to the last one.

    The previous GOP is kept because an open GOP's leading B-frames reference it; other GOPs are skipped,
    which is the CPU counterpart of seeking to the keyframe before each needed run.
    """
    gop_of, gop = [], 0
    for packet in packets:
        if packet.is_keyframe and gop_of:
            gop += 1
        gop_of.append(gop)
    needed = {gop_of[i] for i, p in enumerate(packets) if p.pts in targets}
    needed |= {g - 1 for g in needed}
    last = max(i for i, g in enumerate(gop_of) if g in needed)
    return [p for i, p in enumerate(packets[: last + 1]) if gop_of[i] in needed]


@dataclass(frozen=True)
class CpuDecoder:
    """FrameDecoder on PyAV (FFmpeg's software decoders), `threads` FFmpeg threads (0: FFmpeg's choice).

    Demuxes the file once to map indices to PTS (the sort order of `probe_video`), then decodes only the GOPs
    that hold sampled frames and stops after the last one. Frames are matched to indices by PTS, so frames
    lost to damage do not shift the rest. Packets without PTS, and streams whose timestamps restart (joined clips:
    `probe.unwrapped_pts`), are matched by output order instead, decoding every packet.
    """

    threads: int = 0
    paths: DecodePaths | None = field(default=None, compare=False)  # counts "cpu" per decoded video

    def decode(self, source: Source, frame_indices: Sequence[int]) -> Iterator[np.ndarray]:
        indices = list(frame_indices)
        if not indices:
            return
        check_indices(indices)
        if self.paths is not None:
            self.paths.count("cpu")
        with open_container(source) as container:
            stream = container.streams.video[0]
            stream.thread_type = "SLICE"  # frame threading can deadlock on close when decoding stops early (PyAV #1849)
            stream.codec_context.thread_count = self.threads
            packets = read_packets(container)  # the packets probe_video counted
            if indices[-1] >= len(packets):
                raise MediaError(f"video: frame index {indices[-1]} is past the last frame ({len(packets)} frames)")
            ticks = [p.pts for p in packets]
            by_pts = None not in ticks and unwrapped_pts(packets) == ticks
            if by_pts:
                order = sorted(p.pts for p in packets)
                targets = [order[i] for i in indices]
                packets = _needed_packets(packets, set(targets))
            else:
                targets = indices
            yield from self._match(stream, packets, targets, by_pts)

    @staticmethod
    def _frames(stream: av.video.stream.VideoStream, packets: list[av.Packet]) -> Iterator[av.VideoFrame]:
        for packet in [*packets, None]:  # None flushes the decoder's reorder buffer
            try:
                yield from stream.codec_context.decode(packet)
            except av.FFmpegError:
                continue  # an undecodable packet: its frame is replaced in _match

    def _match(self, stream, packets: list[av.Packet], targets: list[int], by_pts: bool) -> Iterator[np.ndarray]:
        k, previous = 0, None
        cache: list = [None, None]  # [frame, its RGB array]: a frame is converted once however often it is used

        def rgb(frame: av.VideoFrame) -> np.ndarray:
            if cache[0] is not frame:
                cache[:] = [frame, upright_rgb(frame)]
            return cache[1]

        for position, frame in enumerate(self._frames(stream, packets)):
            key = frame.pts if by_pts else position
            if key is None:
                continue
            while k < len(targets) and targets[k] < key:  # that frame was lost: show its neighbour
                yield rgb(previous if previous is not None else frame)
                k += 1
            while k < len(targets) and targets[k] == key:
                yield rgb(frame)
                k += 1
            if k == len(targets):
                return
            previous = frame
        if previous is None:
            raise MediaError("video: corrupt: no frame could be decoded")
        for _ in range(len(targets) - k):
            yield rgb(previous)
