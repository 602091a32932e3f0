"""One GOP task (`gop_plan.DecodeTask`) read with PyAV and decoded packet by packet: the work of a GOP-parallel
CPU worker process (PyAV's decoder) and of an NVDEC session thread (`nvdec_session.NvdecPackets`)."""
from __future__ import annotations

import contextlib
import os
from collections import deque
from dataclasses import dataclass
from typing import Any, Container, Iterator, Protocol

import av
import numpy as np

from flashcodec.decoders import upright_rgb
from flashcodec.errors import MediaError
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


class PacketDecoder(Protocol):
    """A decoder fed the packets `GopReader` chooses, one at a time, in decode order."""

    def decode(self, packet: av.Packet | None, wanted: Container[int]) -> list[tuple[int, Any]]:
        """(PTS, frame) of the frames this packet completes, in presentation order; frames whose PTS is not in
        `wanted` may be left out. None drains: every frame fed so far comes out, and the decoder is then ready
        for a segment that starts at a keyframe. A packet it cannot decode gives no frame (its frame is lost).
        A frame must stay valid until `convert` is called on it, even across later `decode` calls."""
        ...

    def convert(self, frame: Any) -> Any:
        """The frame as the reader's caller gets it (upright)."""
        ...


class PyAVPackets:
    """PacketDecoder on a PyAV (FFmpeg software) codec context; frames become HxWx3 uint8 numpy arrays."""

    def __init__(self, codec: av.codec.context.CodecContext):
        self.codec = codec

    def decode(self, packet: av.Packet | None, wanted: Container[int]) -> list[tuple[int, av.VideoFrame]]:
        try:
            frames = self.codec.decode(packet)
        except av.FFmpegError:
            frames = []  # an undecodable packet: its frame is lost
        if packet is None:
            self.codec.flush_buffers()  # the next segment starts at a keyframe with an empty decoder
        return [(f.pts, f) for f in frames if f.pts is not None]

    convert = staticmethod(upright_rgb)


class GopReader:
    """Runs `GopJob`s on one video file with PyAV, keeping the container open between jobs.

    `threads`: FFmpeg slice threads per decode (1 when processes already use every core). Not thread-safe:
    one reader per worker. A path is opened where the reader runs, by `probe.open_container`, which raises MediaError
    for one that is not a regular file by then (swapped for a FIFO since the video was mapped) or not a video.
    """

    def __init__(self, source: Source, threads: int = 1):
        self.source, self.threads = source, threads
        self._open()

    def _open(self) -> None:
        self._opened = contextlib.ExitStack()  # the container and the file it reads (`probe.open_container`)
        self.container = self._opened.enter_context(open_container(self.source))
        self.stream = self.container.streams.video[0]
        self.stream.thread_type = "SLICE"  # frame threading can deadlock on close when stopping early (PyAV #1849)
        self.stream.codec_context.thread_count = self.threads
        self._packets, self._next = iter_packets(self.container), 0  # the next packet's decode-order index

    def close(self) -> None:
        self._opened.close()

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
        self.close()
        self._open()  # read from the start instead: demuxing is cheap next to decoding
        for _ in zip(range(index), self._packets):
            pass
        self._next = index

    def run(self, job: GopJob, decoder: PacketDecoder | None = None) -> Iterator[list[Any]]:
        """Yield each part's frames in `job.frame_pts` order as soon as the part is decoded, each as `decoder`
        converts it (default PyAV's decoder on this file: HxWx3 uint8 upright numpy arrays). Packets of a
        segment's `skip` are never fed. A frame that did not decode is replaced as `CpuDecoder` replaces it, by
        the frame shown before it in the same segment (the one after it if there is none); None if its segment
        gave no frame at all. Raises DemuxMismatch if the packets read differ from the map.
        """
        codec = decoder or PyAVPackets(self.stream.codec_context)
        slot = {pts: (p, k) for p, part in enumerate(job.frame_pts) for k, pts in enumerate(part)}
        frames: list[list[np.ndarray | None]] = [[None] * len(part) for part in job.frame_pts]
        missing = [len(part) for part in job.frame_pts]
        parts, ready = job.task.parts, 0  # parts handed out
        cache: list = [None, None]  # [frame, its RGB array]: converted once however often it is used

        def put(pts: int, frame: Any) -> None:
            if cache[0] is not frame:
                cache[:] = [frame, codec.convert(frame)]
            p, k = slot[pts]
            frames[p][k] = cache[1]
            missing[p] -= 1

        for segment, pts in zip(job.task.segments, job.packet_pts):
            pending = deque(sorted(t for t in pts if t in slot))  # this segment's targets, in display order
            shown: list = [None]  # the segment's last frame out of the decoder (frames come out in PTS order)

            def take(decoded: list[tuple[int, Any]]) -> None:
                for frame_pts, frame in decoded:
                    while pending and pending[0] < frame_pts:  # passed over: lost, shown as its neighbour
                        put(pending.popleft(), shown[0] if shown[0] is not None else frame)
                    if pending and pending[0] == frame_pts:
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
                take(codec.decode(packet, slot))
                while ready < len(parts) and not missing[ready]:
                    yield frames[ready]
                    ready += 1
            take(codec.decode(None, slot))  # drain the reorder buffer: every frame fed so far comes out
            while pending and shown[0] is not None:
                put(pending.popleft(), shown[0])
            while ready < len(parts) and parts[ready].until_packet <= segment.last_packet:
                yield frames[ready]
                ready += 1
        for p in range(ready, len(parts)):
            yield frames[p]


class ReaderCache:
    """Open `GopReader`s by file, at most `size`, the least recently used closed first; a reader of a file deleted
    or rewritten since is closed (an open file kept in /dev/shm would hold its memory). Not thread-safe: one
    cache per worker process or decoder thread."""

    def __init__(self, threads: int = 1, size: int = 4):
        self.threads, self.size = threads, size
        self._readers: dict[tuple, GopReader] = {}

    def get(self, path: str) -> GopReader:
        """A reader of `path`. Raises MediaError when the file is gone, or as `GopReader` does."""
        for key in [k for k in self._readers if _identity(k[0]) != k]:
            self._readers.pop(key).close()
        key = _identity(path)
        if key is None:
            raise MediaError(f"video: the file {path} is gone")
        reader = self._readers.pop(key, None) or GopReader(path, self.threads)
        self._readers[key] = reader
        if len(self._readers) > self.size:
            self._readers.pop(next(iter(self._readers))).close()
        return reader

    def clear(self) -> None:
        """Close every reader (one may have stopped mid-segment: the next job starts clean)."""
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()


def _identity(path: str) -> tuple | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return path, stat.st_mtime_ns, stat.st_size  # a path rewritten since is another file


def _chain(first: av.Packet, rest: Iterator[av.Packet]) -> Iterator[av.Packet]:
    yield first
    yield from rest
