"""Media metadata before any pixel work: one demux pass for video (PyAV), the header for images (Pillow).

Token counts, admission and frame sampling are decided from this alone (cases C3, C6, C7).
"""
from __future__ import annotations

import contextlib
import functools
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Sequence, Union

import av
from PIL import ExifTags, Image, UnidentifiedImageError

from flashcodec.errors import IMAGE_FORMATS, NOT_AN_IMAGE, MediaError, TooManyPixels
from flashcodec.files import open_source

Source = Union[bytes, str, Path]  # the media file's bytes, or its path
FIRST_PACKETS = 64  # packets kept (with their data) to decode the first frame from
# EXIF orientations whose transform (TIFF 6.0 / EXIF 2.3 tag 0x0112: transpose, rotate 90 either way, transverse)
# swaps width and height; `PIL.ImageOps.exif_transpose` applies them when the pixels are decoded (`images.load_image`).
_SIDEWAYS = frozenset({5, 6, 7, 8})


@dataclass(frozen=True, slots=True)
class PacketMeta:
    """A complete video packet without its data: PTS/DTS/duration in ticks of the stream's time base (None where
    the container has none), size (bytes), file position (bytes; None or -1 when unknown), keyframe flag, and
    `flag`: what the scan's `inspect(packet)` said of its data (e.g. `gop` marks disposable pictures)."""

    pts: int | None
    dts: int | None
    duration: int | None
    size: int
    pos: int | None
    is_keyframe: bool
    flag: bool = False


@dataclass(frozen=True)
class VideoInfo:
    """What a video is, from its container and one decoded frame.

    `width`/`height` are as displayed (after `rotation`); `coded_width`/`coded_height` as stored in the stream.
    `rotation` is clockwise degrees (0, 90, 180, 270) that turn stored frames upright. `fps` is the stream's
    average frame rate (FFmpeg `avg_frame_rate`, what decord/torchcodec report to qwen-vl-utils). `num_frames`
    counts complete video packets. `frame_pts_s` holds every frame's presentation time in seconds, sorted: frame
    index i (presentation order) is shown at `frame_pts_s[i]`. `duration_s` runs from the first frame to the end
    of the last one. `codec` is FFmpeg's codec name ("h264", "hevc", "vp9", "av1"). Pixel aspect ratio is
    ignored, as qwen-vl-utils' readers do. `declared_frames`: the frames an MP4/MOV index (its sample table) says the
    stream has, 0 for other containers (WebM and MPEG-TS give no count; AVI's counts its empty "repeat the last
    frame" entries too, which are no frames): more than `num_frames` when the file was cut short after its index (a
    truncated download), whose frames up to the cut are used.
    """

    width: int
    height: int
    coded_width: int
    coded_height: int
    rotation: int
    fps: float
    num_frames: int
    duration_s: float
    codec: str
    frame_pts_s: tuple[float, ...]
    variable_frame_rate: bool
    declared_frames: int = 0

    @property
    def truncated(self) -> bool:
        """Whether fewer complete frames were read than the container's index declares."""
        return self.declared_frames > self.num_frames


@dataclass(frozen=True)
class ImageInfo:
    """An image's header: size in pixels as displayed (after its EXIF orientation), Pillow mode (e.g. "RGB", "P",
    "I;16"), format (e.g. "PNG") and EXIF orientation (1 = as stored, the default; 1-8 as in the EXIF tag)."""

    width: int
    height: int
    mode: str
    format: str
    orientation: int = 1


@contextlib.contextmanager
def open_container(source: Source) -> Iterator[av.container.InputContainer]:
    """`source` opened with PyAV, closed on exit with the file it reads. A path is opened by `files.open_regular` and
    PyAV reads that open file, so a path swapped for a FIFO after the request's check cannot block the reader.

    Raises MediaError if a path cannot be opened or is not a regular file, FFmpeg cannot read it, it is an image
    format, or it has no video stream.
    """
    file = open_source(source, "video")
    with file, _video_container(file) as container:
        yield container


def _video_container(file: BinaryIO) -> av.container.InputContainer:
    """PyAV's container of the open `file` (left open: the caller closes it). Raises MediaError as `open_container`."""
    try:
        container = av.open(file, metadata_errors="ignore")
    except (av.FFmpegError, OSError) as exc:  # strerror: FFmpeg's words without the errno and the file's name; an
        # OSError: the file's own seek or read, e.g. EINVAL for a file truncated while FFmpeg reads it
        raise MediaError("video: not a decodable video file, or truncated before its index "
                         f"({exc.strerror or exc})") from exc
    name = container.format.name
    if name.endswith("_pipe"):  # from a file object FFmpeg knows images by content alone (jpeg_pipe, png_pipe)
        container.close()
        raise MediaError(f"video: this is an image ({name}), not a video file")
    if not container.streams.video:
        audio = bool(container.streams.audio)
        container.close()
        if audio:
            raise MediaError("video: the file has no video stream (audio only)")
        # An MP4 cut inside its index (moov) opens with no stream, or a data stream without a codec.
        raise MediaError("video: not a decodable video file, or truncated before its index (no video stream found)")
    return container


def read_packets(container: av.container.InputContainer) -> list[av.Packet]:
    """The complete packets of the first video stream, in decode order (one demux pass, no decoding).

    Empty and incomplete packets (a file cut short) are dropped; a container damaged part-way gives the packets
    read before the damage.
    """
    return list(iter_packets(container))


def scan_packets(container: av.container.InputContainer, inspect: Callable[[av.Packet], bool] | None = None
                 ) -> tuple[list[PacketMeta], list[av.Packet]]:
    """One demux pass keeping only what metadata needs: every complete packet's `PacketMeta` (decode order) and
    the first FIRST_PACKETS packets themselves (for the first frame), so a long video's packet data is never held
    at once (446 MB for 10 minutes of 1080p H.264 at 6 Mbit/s; bench/RESULTS.md, "metadata pass memory").
    `inspect(packet)` runs on each packet while its data is there; its answer is `PacketMeta.flag`."""
    metas: list[PacketMeta] = []
    first: list[av.Packet] = []
    for packet in iter_packets(container):
        metas.append(PacketMeta(packet.pts, packet.dts, packet.duration, packet.size, packet.pos, packet.is_keyframe,
                                bool(inspect and inspect(packet))))
        if len(first) < FIRST_PACKETS:
            first.append(packet)
    return metas, first


def iter_packets(container: av.container.InputContainer) -> Iterator[av.Packet]:
    """`read_packets` one by one, from wherever the container is (after a seek, too)."""
    try:
        for packet in container.demux(container.streams.video[0]):
            if packet.size and not packet.is_corrupt:
                yield packet
    except (av.FFmpegError, OSError):  # OSError: the file's own read or seek (it shrank while it was read)
        return  # damage: keep what was read; the caller decides whether that is enough


def _first_frame(stream: av.video.stream.VideoStream, packets: list[av.Packet]) -> av.VideoFrame | None:
    for packet in [*packets, None]:
        try:
            frames = stream.codec_context.decode(packet)
        except av.FFmpegError:
            continue
        if frames:
            return frames[0]
    return None


def unwrapped_pts(packets: Sequence[PacketMeta | av.Packet]) -> list[int | None]:
    """Each packet's PTS (decode order, ticks of the stream's time base) on one timeline. Where a keyframe's PTS is at
    or below the largest PTS before it, the stream's timestamps restart (clips joined without remuxing, e.g. MPEG-TS
    files concatenated with ``cat``): that keyframe and every packet after it move to start one frame (the keyframe
    packet's duration, else the median step between the frames so far, else one tick) after that largest PTS, so the
    clips play one after the other, as they decode (and as a frame-index reader such as OpenCV's, vLLM's video
    loader, reads them). Without a PTS on every packet, the PTS as they are (decode order is the presentation
    order then: `_timing`)."""
    pts = [p.pts for p in packets]
    if None in pts:
        return pts
    out: list[int] = []
    shift, top = 0, None
    for packet, t in zip(packets, pts):
        if top is not None and packet.is_keyframe and t + shift <= top:
            shown = sorted(out)
            steps = sorted(b - a for a, b in zip(shown, shown[1:]) if b > a)
            step = packet.duration or (steps[len(steps) // 2] if steps else 1)
            shift = top + step - t
        out.append(t + shift)
        top = out[-1] if top is None else max(top, out[-1])
    return out


def _timing(stream: av.video.stream.VideoStream, packets: list[PacketMeta]) -> tuple[list[float], float, float, bool]:
    """(sorted PTS in s, average fps, duration in s, variable frame rate?) of a stream's complete packets, their
    timestamps unwrapped where they restart (`unwrapped_pts`)."""
    time_base = float(stream.time_base or 0)
    rate = float(stream.average_rate or stream.guessed_rate or 0)
    ticks = unwrapped_pts(packets)
    pts = sorted(t * time_base for t in ticks if t is not None)
    if len(pts) != len(packets):
        if not rate:
            raise MediaError("video: no timestamps and no frame rate")
        pts = [i / rate for i in range(len(packets))]
    deltas = [b - a for a, b in zip(pts, pts[1:])]
    # the last frame lasts its packet's duration, else as long as the frame before it
    last = packets[max(range(len(packets)), key=lambda i: ticks[i] if ticks[i] is not None else 0)]
    last_duration = (last.duration or 0) * time_base or (deltas[-1] if deltas else 1 / rate if rate else 0.0)
    duration = pts[-1] - pts[0] + last_duration
    # one frame: the time it shows is its rate (a 1-frame GIF's stream rate is its time base's, 100 where it lasts
    # 0.1 s: 10 fps, as a 3-frame GIF of the same frames reads)
    fps = len(pts) / duration if duration > 0 and (len(pts) == 1 or not rate) else rate
    if fps <= 0:
        raise MediaError("video: frame rate unknown")
    # Timestamps rounded to the time base jitter by a tick or two; a real rate change moves more than 10%.
    vfr = bool(deltas) and max(deltas) - min(deltas) > max(2 * time_base, 0.1 * statistics.median(deltas))
    return pts, fps, duration, vfr


def probe_video(source: Source) -> VideoInfo:
    """Metadata of `source`'s first video stream from one demux pass.

    Only the first frame is decoded: PyAV 16 exposes the display matrix (rotation) on frames only, and this
    also proves the stream decodable. Only complete packets count (`read_packets`). Packets without
    timestamps get `i / fps`. Raises MediaError for a file that is not a video, has no video stream, no
    complete packet, no decodable frame, or no frame rate, and for a path that cannot be opened or is not a regular
    file by the time it is opened (`open_container`).
    """
    with open_container(source) as container:
        return info_from_packets(container.streams.video[0], *scan_packets(container))


def clockwise_turn(frame: av.VideoFrame) -> int:
    """How far `frame` is turned clockwise for display (degrees: 0, 90, 180, 270), from its display matrix: FFmpeg's
    angle is counter-clockwise, rounded to a quarter turn. A matrix with no angle (all zeros: FFmpeg's is NaN, which
    PyAV gives as the smallest int) is none, as FFmpeg's autorotate ignores it."""
    angle = frame.rotation
    return round(-angle / 90) * 90 % 360 if -360 <= angle <= 360 else 0


def info_from_packets(stream: av.video.stream.VideoStream, packets: list[PacketMeta],
                      first: list[av.Packet]) -> VideoInfo:
    """`VideoInfo` of `stream` from its complete packets' metadata and its first packets (`scan_packets`),
    decoding only the first frame.

    The body of `probe_video`, shared with `gop.analyse_bitstream` so that both read the file once.
    Raises MediaError as `probe_video` does.
    """
    if not packets:
        raise MediaError("video: truncated or empty: no complete video packet")
    codec = stream.codec_context.codec.canonical_name
    frame = _first_frame(stream, first)
    if frame is None:
        raise MediaError(f"video: corrupt: no frame of the {codec} stream decodes")
    pts, fps, duration, vfr = _timing(stream, packets)
    rotation = clockwise_turn(frame)
    turned = rotation in (90, 270)
    return VideoInfo(
        width=frame.height if turned else frame.width,
        height=frame.width if turned else frame.height,
        coded_width=frame.width,
        coded_height=frame.height,
        rotation=rotation,
        fps=fps,
        num_frames=len(pts),
        duration_s=duration,
        codec=codec,
        frame_pts_s=tuple(pts),
        variable_frame_rate=vfr,
        declared_frames=max(stream.frames or 0, 0) if "mp4" in stream.container.format.name.split(",") else 0,
    )


def exif_orientation(img: Image.Image) -> int:
    """The EXIF orientation (1-8; 1 when there is none or it is not one of those) of an opened, not yet loaded image,
    as its header gives it: JPEG, WebP and TIFF, and PNG when its eXIf chunk comes before the pixel data (where
    Pillow writes it; one after them is left out: reading it would decode the pixels, and the probe must not)."""
    if img.format == "PNG" and "exif" not in img.info:
        return 1
    orientation = img.getexif().get(ExifTags.Base.Orientation, 1)
    return orientation if isinstance(orientation, int) and 1 <= orientation <= 8 else 1


@functools.cache
def image_formats() -> tuple[str, ...]:
    """The formats of `flashcodec.errors.IMAGE_FORMATS` that this Pillow has a plugin for (AVIF and WebP need their
    libraries), for `Image.open`'s ``formats`` (an unknown name there is a KeyError)."""
    Image.init()
    return tuple(f for f in IMAGE_FORMATS if f in Image.OPEN)


def probe_image(data: Source) -> ImageInfo:
    """Size, mode, format and EXIF orientation from the image header (Pillow opens lazily: no pixel decode; from a
    path, only the header is read). The size is the upright one, which the pixels will have once decoded
    (`images.load_image`): width and height swapped for an orientation that turns the image on its side.

    Raises MediaError if Pillow cannot identify the bytes as one of `image_formats`, the image exceeds Pillow's
    decompression-bomb limit, or a path is not a regular file by the time it is opened (`files.open_regular`: a
    FIFO would block the reader).
    """
    source = open_source(data, "image")
    try:
        with source, Image.open(source, formats=image_formats()) as img:
            orientation = exif_orientation(img)
            width, height = (img.height, img.width) if orientation in _SIDEWAYS else (img.width, img.height)
            return ImageInfo(width=width, height=height, mode=img.mode, format=img.format or "",
                             orientation=orientation)
    except Image.DecompressionBombError as exc:
        raise TooManyPixels() from exc
    except UnidentifiedImageError as exc:
        raise MediaError(NOT_AN_IMAGE) from exc
    except (OSError, SyntaxError, ValueError) as exc:
        raise MediaError(f"image: not a decodable image ({exc})") from exc
