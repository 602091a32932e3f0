"""One GOP task (`gop_plan.DecodeTask`) decoded with PyAV: the work of a GOP-parallel CPU worker process."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterator

import av
import numpy as np

from flashcodec.decoders import upright_rgb
from flashcodec.gop import BitstreamMap
from flashcodec.gop_plan import DecodeTask
from flashcodec.probe import Source, iter_packets, open_container


@dataclass(frozen=True)
class GopJob:
    """A `DecodeTask` with the timestamps a decoder needs to find and check its packets without the map.

    `packet_pts[s]`: PTS (stream ticks) of segment s's packets in decode order, the first its keyframe's;
    `frame_pts[p]`: PTS of part p's frames, in `task.parts[p].frames` order.
    """

    task: DecodeTask
    packet_pts: tuple[tuple[int, ...], ...]
    frame_pts: tuple[tuple[int, ...], ...]

    @staticmethod
    def of(bmap: BitstreamMap, task: DecodeTask) -> GopJob:
        """The job of `task` planned on `bmap` (which must have `exact_timestamps`)."""
        pts = bmap.packet_pts
        return GopJob(
            task=task,
            packet_pts=tuple(tuple(pts[s.first_packet : s.last_packet + 1]) for s in task.segments),
            frame_pts=tuple(tuple(pts[bmap.frame_packet[f]] for f in part.frames) for part in task.parts),
        )


class DemuxMismatch(RuntimeError):
    """The packets read for a job are not those of the map (the file changed, or a demuxer is inconsistent)."""


class GopReader:
    """Runs `GopJob`s on one video file with PyAV, keeping the container open between jobs.

    `threads`: FFmpeg slice threads per decode (1 when processes already use every core). Not thread-safe:
    one reader per worker.
    """

    def __init__(self, source: Source, threads: int = 1):
        self.source, self.threads = source, threads
        self._open()

    def _open(self) -> None:
        self.container = open_container(self.source)
        self.stream = self.container.streams.video[0]
        self.stream.thread_type = "SLICE"  # frame threading can deadlock on close when stopping early (PyAV #1849)
        self.stream.codec_context.thread_count = self.threads
        self._packets, self._next = iter_packets(self.container), 0  # the next packet's decode-order index

    def close(self) -> None:
        self.container.close()

    def _goto(self, index: int, key_pts: int) -> None:
        """Make packet `index` (a keyframe with PTS `key_pts`, unique in the stream) the next one read."""
        if index == self._next:
            return
        # Seek by PTS: MP4 indexes keyframes at their DTS shifted by the B-frame delay, which lands on or
        # before the keyframe; the scan below then finds it without decoding anything.
        self.container.seek(key_pts, stream=self.stream, backward=True, any_frame=False)
        self._packets = iter_packets(self.container)
        for packet in self._packets:
            if packet.pts == key_pts:
                self._packets = _chain(packet, self._packets)
                self._next = index
                return
            if packet.is_keyframe and packet.pts is not None and packet.pts > key_pts:
                break  # overshot: this container's seek is not exact
        self.container.close()
        self._open()  # read from the start instead: demuxing is cheap next to decoding
        for _ in zip(range(index), self._packets):
            pass
        self._next = index

    def run(self, job: GopJob) -> Iterator[list[np.ndarray | None]]:
        """Yield each part's frames (HxWx3 uint8, upright) in `job.frame_pts` order as soon as the part is
        decoded. A frame that did not decode is replaced as `CpuDecoder` replaces it, by the frame shown before
        it in the same segment (the one after it if there is none); None if its segment gave no frame at all.
        Raises DemuxMismatch if the packets read differ from the map.
        """
        codec = self.stream.codec_context
        slot = {pts: (p, k) for p, part in enumerate(job.frame_pts) for k, pts in enumerate(part)}
        frames: list[list[np.ndarray | None]] = [[None] * len(part) for part in job.frame_pts]
        missing = [len(part) for part in job.frame_pts]
        parts, ready = job.task.parts, 0  # parts handed out
        cache: list = [None, None]  # [frame, its RGB array]: converted once however often it is used

        def put(pts: int, frame: av.VideoFrame) -> None:
            if cache[0] is not frame:
                cache[:] = [frame, upright_rgb(frame)]
            p, k = slot[pts]
            frames[p][k] = cache[1]
            missing[p] -= 1

        for segment, pts in zip(job.task.segments, job.packet_pts):
            pending = deque(sorted(t for t in pts if t in slot))  # this segment's targets, in display order
            shown: list = [None]  # the segment's last frame out of the decoder (frames come out in PTS order)

            def take(decoded: list[av.VideoFrame]) -> None:
                for frame in decoded:
                    if frame.pts is None:
                        continue
                    while pending and pending[0] < frame.pts:  # passed over: lost, shown as its neighbour
                        put(pending.popleft(), shown[0] if shown[0] is not None else frame)
                    if pending and pending[0] == frame.pts:
                        put(pending.popleft(), frame)
                    shown[0] = frame

            self._goto(segment.first_packet, pts[0])
            for expected in pts:
                packet = next(self._packets, None)
                if packet is None:
                    break  # a file cut short
                self._next += 1
                if packet.pts != expected:
                    raise DemuxMismatch(f"packet {self._next - 1}: PTS {packet.pts}, the map says {expected}")
                if self._next - 1 in segment.skip:
                    continue  # nothing references it and it is not wanted: never decoded
                try:
                    take(codec.decode(packet))
                except av.FFmpegError:
                    continue  # an undecodable packet: its frame is lost
                while ready < len(parts) and not missing[ready]:
                    yield frames[ready]
                    ready += 1
            try:
                take(codec.decode(None))  # drain the reorder buffer: every frame fed so far comes out
            except av.FFmpegError:
                pass
            codec.flush_buffers()  # the next segment starts at a keyframe with an empty decoder
            while pending and shown[0] is not None:
                put(pending.popleft(), shown[0])
            while ready < len(parts) and parts[ready].until_packet <= segment.last_packet:
                yield frames[ready]
                ready += 1
        for p in range(ready, len(parts)):
            yield frames[p]


def _chain(first: av.Packet, rest: Iterator[av.Packet]) -> Iterator[av.Packet]:
    yield first
    yield from rest
