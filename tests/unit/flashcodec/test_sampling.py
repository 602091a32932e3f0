"""Qwen2.5-VL sampling and sizing rules: equal to qwen-vl-utils 0.0.14 where it is defined (cases C1, C3, C7)."""
import itertools

import pytest

from flashcodec import sampling as S
from flashcodec.errors import MediaError
from flashcodec.families import family
from flashcodec.probe import ImageInfo, VideoInfo

SIDES = [1, 13, 27, 28, 29, 55, 56, 100, 224, 333, 480, 720, 1080, 1920, 3840, 5000]
PIXEL_BOUNDS = [(None, None), (S.VIDEO_MIN_PIXELS, S.VIDEO_MAX_PIXELS), (256 * 784, 1280 * 784), (3136, 12544)]
QWEN = family("qwen2_5_vl")


def cfr_info(width: int, height: int, num_frames: int, fps: float) -> VideoInfo:
    """Metadata of a constant-frame-rate video, as probe_video reports it (no file needed: C7 is metadata-only)."""
    pts = tuple(i / fps for i in range(num_frames))
    return VideoInfo(width, height, width, height, 0, fps, num_frames, num_frames / fps, "h264", pts, False)


def test_smart_resize_equals_qwen_vl_utils_on_a_grid():
    vp = pytest.importorskip("qwen_vl_utils.vision_process")
    for (h, w), (lo, hi) in itertools.product(itertools.product(SIDES, SIDES), PIXEL_BOUNDS):
        try:
            expected = vp.smart_resize(h, w, 28, lo, hi)
        except ValueError:
            with pytest.raises(MediaError, match="aspect ratio"):
                S.smart_resize(h, w, 28, lo, hi)
            continue
        got = S.smart_resize(h, w, 28, lo, hi)
        # deviation (C1): qwen-vl-utils floors a side to 0 on a strong downscale; we keep 28 like transformers
        assert got == tuple(max(28, side) for side in expected), (h, w, lo, hi)


def test_smart_nframes_equals_qwen_vl_utils_on_a_grid():
    vp = pytest.importorskip("qwen_vl_utils.vision_process")
    totals = [1, 2, 3, 4, 5, 7, 10, 26, 50, 100, 250, 1000, 2000, 18000]
    rates = [1, 5, 12.5, 23.976, 25, 29.97, 60, 120]
    for total, video_fps, fps in itertools.product(totals, rates, [0.5, 1, 2, 4, 30]):
        try:
            expected = vp.smart_nframes({"fps": fps}, total_frames=total, video_fps=video_fps)
        except ValueError:
            with pytest.raises(ValueError, match="nframes"):
                S.smart_nframes(total, video_fps, fps)
            continue
        assert S.smart_nframes(total, video_fps, fps) == expected, (total, video_fps, fps)


@pytest.mark.parametrize(
    "size, expected",  # (width, height) -> (resized height, width), by hand from qwen-vl-utils' formulas (C1)
    [((26, 28), (84, 56)), ((27, 27), (56, 56)), ((1, 1), (56, 56)), ((332, 27), (28, 336)), ((27, 1000), (1008, 28)),
     ((690, 15420), (15428, 700)), ((640, 360), (364, 644))],
)
def test_plan_image_small_and_elongated_images(size, expected):
    plan = S.plan_image(ImageInfo(size[0], size[1], "RGB", "PNG"))
    h, w = expected
    assert (plan.resized_height, plan.resized_width) == expected
    assert plan.grid_thw == (1, h // 14, w // 14)
    assert plan.num_patches == h * w // 196 and plan.num_tokens == plan.num_patches // 4


def test_plan_image_extreme_aspect_ratio_names_the_limit():
    with pytest.raises(MediaError, match=r"image: aspect ratio 400\.0 .* limit of 200"):
        S.plan_image(ImageInfo(20000, 50, "RGB", "PNG"))


def test_max_pixels_downscale_never_goes_below_the_merge_unit():
    plan = S.plan_image(ImageInfo(1000, 27, "RGB", "PNG"), max_pixels=3136, min_pixels=3136)
    assert plan.resized_height == 28 and plan.resized_width % 28 == 0 and plan.resized_width >= 28


def test_smart_nframes_by_hand():
    assert S.smart_nframes(250, 25) == 20  # 10 s * 2 fps
    assert S.smart_nframes(132, 25) == 10  # 10.56 floored to even
    assert S.smart_nframes(26, 25) == 4  # 2.08 raised to FPS_MIN_FRAMES
    assert S.smart_nframes(5, 25) == 4  # a 0.2 s clip
    assert S.smart_nframes(3, 25) == 2  # capped by the frames that exist, floored to even
    assert S.smart_nframes(18000, 30) == 768  # FPS_MAX_FRAMES
    with pytest.raises(ValueError, match="nframes"):
        S.smart_nframes(1, 25)


@pytest.mark.parametrize(
    "total, expected",  # case C3: short clips sample what exists; one frame is repeated to fill the temporal patch
    [(1, (0, 0)), (2, (0, 1)), (3, (0, 2)), (5, (0, 1, 3, 4)), (26, (0, 8, 17, 25))],
)
def test_plan_video_short_clips(total, expected):
    plan = S.plan_video(cfr_info(64, 48, total, 25.0))
    assert plan.frame_indices == expected
    assert plan.num_groups == plan.grid_thw[0] == len(expected) // 2
    assert plan.sampled_fps == pytest.approx(len(expected) / total * 25.0)
    assert plan.second_per_grid_t == pytest.approx(2 / plan.sampled_fps)


def test_plan_video_counts_tokens_from_metadata_only():
    # C7: 60 s of 1280x720 at 30 fps: 120 frames of 560x1008 (per-frame cap 768*28*28 binds)
    plan = S.plan_video(cfr_info(1280, 720, 1800, 30.0))
    assert len(plan.frame_indices) == 120 and (plan.resized_height, plan.resized_width) == (560, 1008)
    assert plan.grid_thw == (60, 40, 72) and plan.patches_per_group == 2880 and plan.tokens_per_group == 720
    # 10 minutes of 360p: 768 frames, so the total budget 128000*28*28*0.9 / 768 * 2 = 235200 px binds
    plan = S.plan_video(cfr_info(640, 360, 18000, 30.0))
    assert (plan.num_groups, plan.resized_height, plan.resized_width) == (384, 364, 644)
    assert plan.num_groups * plan.tokens_per_group == 384 * 299


def test_plan_video_options():
    info = cfr_info(640, 272, 250, 25.0)
    assert len(S.plan_video(info, fps=1.0).frame_indices) == 10
    small = S.plan_video(info, max_pixels=200704, min_pixels=3136)
    assert small.resized_height * small.resized_width <= 200704
    assert S.plan_video(info, max_pixels=10**9).resized_width == S.plan_video(info).resized_width  # never raised


@pytest.mark.parametrize("kwargs, key", [
    ({"fps": 0}, "fps"), ({"fps": float("nan")}, "fps"), ({"fps": "2"}, "fps"), ({"fps": -1.0}, "fps"),
    ({"max_pixels": 0}, "max_pixels"), ({"min_pixels": 2.5}, "min_pixels"),
    ({"min_pixels": 500000, "max_pixels": 100000}, "min_pixels"),
])
def test_plan_video_rejects_bad_options(kwargs, key):
    with pytest.raises(ValueError, match=key):
        S.plan_video(cfr_info(640, 272, 250, 25.0), **kwargs)


def test_video_max_pixels_below_the_frame_minimum_names_max_pixels():
    # The request cannot set min_pixels: the error says what max_pixels must be.
    with pytest.raises(ValueError, match=r"^max_pixels must be at least 100352 for a video .*got 100351$"):
        S.plan_video(cfr_info(640, 272, 250, 25.0), max_pixels=S.VIDEO_MIN_PIXELS - 1)
    assert S.plan_video(cfr_info(640, 272, 250, 25.0), max_pixels=S.VIDEO_MIN_PIXELS).resized_height > 0


def test_plan_image_rejects_bad_options():
    with pytest.raises(ValueError, match="max_pixels"):
        S.plan_image(ImageInfo(64, 64, "RGB", "PNG"), max_pixels=-5)


def test_groups_from_keeps_the_later_groups_frames_renumbered():
    plan = S.plan_video(cfr_info(64, 48, 250, 25.0))  # 10 s at 2 fps: 20 frames, 10 groups
    tail = QWEN.video_groups_from(plan, 7)
    assert tail.num_groups == 3 and tail.grid_thw == (3, *plan.grid_thw[1:])
    assert tail.frame_indices == plan.frame_indices[14:] and tail.frame_times_s == plan.frame_times_s[14:]
    assert tail.patches_per_group == plan.patches_per_group and QWEN.video_groups_from(plan, 0) == plan
    with pytest.raises(ValueError, match="group 10"):
        QWEN.video_groups_from(plan, 10)
