"""max_visual_tokens: a request's media lowered to fit (videos' fps first, then every item's pixels), by Qwen2.5-VL's
own sampling rules, from metadata alone."""
import random

import pytest

from flashcodec.families import MediaOptions, family
from flashcodec.families.cap import total_tokens
from flashcodec.probe import ImageInfo
from flashcodec.sampling import IMAGE_MIN_PIXELS, VIDEO_MIN_PIXELS, plan_image, plan_video
from orchestrator.prompt import QWEN
from orchestrator.sampling_params import InvalidInput
from orchestrator.visual_cap import fit_visual_tokens
from tests.unit.flashcodec.test_sampling import cfr_info

MINUTES_3_720P = cfr_info(1280, 720, 180 * 30, 30.0)  # 3 minutes at 30 fps: 360 frames at 2 fps
PHOTO = ImageInfo(4032, 3024, "RGB", "JPEG")


def test_media_within_the_cap_are_planned_as_sent():
    plans, applied = fit_visual_tokens(QWEN, [PHOTO], MediaOptions(2.0, None), 100_000)
    assert applied is None and plans == [plan_image(PHOTO)]
    plans, applied = fit_visual_tokens(QWEN, [MINUTES_3_720P], MediaOptions(2.0, None), None)  # no cap
    assert applied is None and plans == [plan_video(MINUTES_3_720P, fps=2.0)]


@pytest.mark.parametrize("cap", [60_000, 20_000, 8_000])
def test_a_long_video_gets_the_highest_fps_that_fits(cap):
    full = total_tokens([plan_video(MINUTES_3_720P, fps=2.0)])
    plans, applied = fit_visual_tokens(QWEN, [MINUTES_3_720P], MediaOptions(2.0, None), cap)
    assert full > cap >= total_tokens(plans) == applied.visual_tokens and applied.requested == full
    assert applied.fps < 2.0 and applied.max_pixels == (None,)  # fewer frames sufficed: pixels untouched
    assert plans == [plan_video(MINUTES_3_720P, fps=applied.fps)]  # the model's own rule at the new fps
    assert total_tokens([plan_video(MINUTES_3_720P, fps=applied.fps * 1.01)]) > cap  # no higher fps fits


def test_below_the_fewest_frames_pixels_are_lowered_but_not_under_the_minimum():
    plans, applied = fit_visual_tokens(QWEN, [MINUTES_3_720P], MediaOptions(2.0, None), 600)
    (plan,) = plans
    assert len(plan.frame_indices) == 4 and total_tokens(plans) <= 600  # qwen-vl-utils' FPS_MIN_FRAMES
    # the fps reported is the highest that gives those 4 frames (4 / 180 s .. 6 / 180 s), not a floor near 0
    assert 0.03 < applied.fps < 6 / 180 and len(plan_video(MINUTES_3_720P, fps=applied.fps * 1.01).frame_indices) > 4
    assert applied.max_pixels[0] >= VIDEO_MIN_PIXELS and plan.resized_height * plan.resized_width <= applied.max_pixels[0]


def test_images_are_shrunk_together_to_fit():
    infos = [PHOTO, ImageInfo(640, 480, "RGB", "PNG"), ImageInfo(8000, 200, "L", "PNG")]
    before = total_tokens(fit_visual_tokens(QWEN, infos, MediaOptions(2.0, None), None)[0])
    plans, applied = fit_visual_tokens(QWEN, infos, MediaOptions(2.0, None), before // 4)
    assert total_tokens(plans) <= before // 4 and applied.fps is None
    assert all(px >= IMAGE_MIN_PIXELS for px in applied.max_pixels)
    assert [p.num_tokens for p in plans] == [plan_image(i, max_pixels=px).num_tokens
                                             for i, px in zip(infos, applied.max_pixels)]


def test_the_requests_own_fps_and_max_pixels_stay_upper_bounds():
    plans, applied = fit_visual_tokens(QWEN, [MINUTES_3_720P, PHOTO], MediaOptions(1.0, 200_000), 5_000)
    assert applied.fps is None or applied.fps <= 1.0
    assert all(p.resized_height * p.resized_width <= 200_000 for p in plans)


def test_the_requests_min_pixels_is_the_floor_the_cap_keeps():
    """Qwen2.5-VL's min_pixels (qwen-vl-utils' and transformers' kwarg) sizes each item up to it; the cap lowers
    max_pixels no further than it."""
    small = ImageInfo(112, 112, "RGB", "PNG")
    (plan,), _ = fit_visual_tokens(QWEN, [small], MediaOptions(min_pixels=200_704), None)
    assert plan == plan_image(small, min_pixels=200_704) and plan.resized_height * plan.resized_width >= 200_704
    assert plan == QWEN.plan_image(small, MediaOptions(min_pixels=200_704))
    infos = [PHOTO, PHOTO]
    plans, applied = fit_visual_tokens(QWEN, infos, MediaOptions(min_pixels=100_000), 400)
    assert all(px >= 100_000 for px in applied.max_pixels) and total_tokens(plans) <= 400
    assert all(p.resized_height * p.resized_width >= 100_000 for p in plans)


def test_a_cap_below_the_smallest_plans_is_refused_naming_it():
    refused = "^image and video inputs: .* at the lowest fps and pixels, over max_visual_tokens 100 .*send fewer"
    with pytest.raises(InvalidInput, match=refused):
        fit_visual_tokens(QWEN, [MINUTES_3_720P, PHOTO], MediaOptions(2.0, None), 100)
    with pytest.raises(InvalidInput, match="^image inputs: .* send fewer or smaller images$"):
        fit_visual_tokens(QWEN, [PHOTO, PHOTO], MediaOptions(2.0, None), 1)
    with pytest.raises(InvalidInput, match="^video inputs: .* send fewer or shorter videos$"):
        fit_visual_tokens(QWEN, [MINUTES_3_720P], MediaOptions(2.0, None), 100)


def test_random_media_always_fit_or_are_refused():
    rng = random.Random(0)
    for _ in range(40):
        infos = [cfr_info(rng.randrange(64, 3840), rng.randrange(64, 2160), rng.randrange(2, 3000), 30.0)
                 if rng.random() < 0.5 else ImageInfo(rng.randrange(100, 6000), rng.randrange(100, 6000), "RGB", "PNG")
                 for _ in range(rng.randrange(1, 5))]
        cap = rng.randrange(200, 50_000)
        try:
            plans, applied = fit_visual_tokens(QWEN, infos, MediaOptions(2.0, None), cap)
        except InvalidInput:
            continue
        assert total_tokens(plans) <= cap
        assert applied is None or applied.visual_tokens == total_tokens(plans) < applied.requested


INTERNVL = family("internvl3")


def test_internvl_lowers_every_videos_frames_first_then_the_images_tiles():
    infos = [MINUTES_3_720P, PHOTO]  # 8 frames (2048 tokens) and 12 tiles + a thumbnail (3328 tokens)
    full = total_tokens(fit_visual_tokens(INTERNVL, infos, MediaOptions(), None)[0])
    assert full == 256 * (8 + 13)
    plans, applied = fit_visual_tokens(INTERNVL, infos, MediaOptions(), full - 600)
    assert (applied.num_frames, applied.max_tiles, applied.fps, applied.max_pixels) == (5, None, None, None)
    assert plans[0] == INTERNVL.plan_video(MINUTES_3_720P, MediaOptions(num_frames=5))
    plans, applied = fit_visual_tokens(INTERNVL, infos, MediaOptions(), 256 * 6)
    assert applied.num_frames == 1 and applied.max_tiles is not None and total_tokens(plans) <= 256 * 6
    assert plans[1] == INTERNVL.plan_image(PHOTO, MediaOptions(max_tiles=applied.max_tiles))
    assert total_tokens([plans[0], INTERNVL.plan_image(PHOTO, MediaOptions(max_tiles=applied.max_tiles + 1))]) > 256 * 6
    assert applied.to_json()["num_frames"] == 1


def test_internvl_keeps_the_requests_max_tiles_as_a_bound_and_refuses_below_one_tile_and_frame():
    _, applied = fit_visual_tokens(INTERNVL, [PHOTO, PHOTO], MediaOptions(max_tiles=4), 256 * 6)
    assert applied.max_tiles is not None and applied.max_tiles < 4
    with pytest.raises(InvalidInput, match="lowest num_frames and max_tiles, over max_visual_tokens 300"):
        fit_visual_tokens(INTERNVL, [MINUTES_3_720P, PHOTO], MediaOptions(), 300)


def test_internvl_lowers_max_tiles_no_lower_than_the_requests_min_tiles():
    """The request's min_tiles stays a lower bound of every image's grid, as its max_tiles stays an upper one: two
    photos (4:3) fit 9 tiles at max_tiles 3 (one tile each) but not at min_tiles 4 (2 x 2 and a thumbnail each), and
    are refused naming min_tiles; with dynamic_image_size false (one tile each whatever min_tiles says) there is
    nothing to lower."""
    _, applied = fit_visual_tokens(INTERNVL, [PHOTO, PHOTO], MediaOptions(), 256 * 9)
    assert applied.max_tiles == 3
    plans, applied = fit_visual_tokens(INTERNVL, [PHOTO, PHOTO], MediaOptions(min_tiles=4), 256 * 12)
    assert applied.max_tiles == 5 and [(p.columns, p.rows, p.num_groups) for p in plans] == [(2, 2, 5)] * 2
    with pytest.raises(InvalidInput, match=r"need at least 2560 visual tokens at the lowest num_frames and max_tiles "
                                           r"\(max_tiles no lower than min_tiles 4\), over max_visual_tokens 2304"):
        fit_visual_tokens(INTERNVL, [PHOTO, PHOTO], MediaOptions(min_tiles=4), 256 * 9)
    plans, applied = fit_visual_tokens(INTERNVL, [PHOTO, PHOTO], MediaOptions(min_tiles=4, dynamic_image_size=False),
                                       256 * 2)
    assert applied is None and total_tokens(plans) == 256 * 2
