"""InternVL3's metadata rules (flashcodec/families/internvl3.py) against transformers 5.17's InternVL processor:
tile grids and counts (GotOcr2ImageProcessor), sampled frames (InternVLVideoProcessor.sample_frames), the prompt
text (InternVLProcessor.replace_image_token / replace_video_token), and the errors of bad input."""
from __future__ import annotations

import itertools

import pytest
import torch

from flashcodec.errors import MediaError
from flashcodec.families import MediaOptions, family
from flashcodec.families.internvl3 import InternVL3, InternVL3Config, best_grid, segment_indices, tile_grids
from flashcodec.probe import ImageInfo, probe_video
from tests.media import make_video

pytest.importorskip("torchvision")  # the reference processors need it
from transformers.models.got_ocr2.image_processing_got_ocr2 import (  # noqa: E402
    get_all_supported_aspect_ratios, get_optimal_tiled_canvas)
from transformers.video_utils import VideoMetadata  # noqa: E402

from tests.unit.flashcodec import internvl3_reference as ref  # noqa: E402

INTERNVL = family("internvl3")
# tiny, extreme aspect ratios, exact tile multiples (and one px off), the aspect-ratio ties (1:1, 2:1, 3:2 ...)
SIZES = [(1, 1), (1, 2000), (2000, 1), (2, 3), (13, 17), (27, 1000), (448, 448), (447, 448), (449, 448), (896, 448),
         (448, 896), (1344, 896), (1792, 1344), (5376, 448), (448, 5376), (640, 480), (1280, 720), (1920, 1080),
         (224, 224), (300, 450), (4000, 3000), (600, 400), (896, 1343), (1000, 1000), (3, 1000)]


@pytest.mark.parametrize("low, high", [(1, 12), (1, 1), (2, 6), (4, 4), (1, 40), (7, 12)])
def test_tile_grids_are_the_processors(low, high):
    assert tile_grids(low, high) == get_all_supported_aspect_ratios(low, high)


def test_best_grid_is_the_processors_on_every_small_size():
    """Every size up to 64 x 64 px and a sweep of larger ones: the aspect ratios, ties and the area rule."""
    sizes = itertools.chain(itertools.product(range(1, 65), repeat=2),
                            itertools.product(range(100, 5000, 37), range(90, 4000, 53)))
    for (height, width), (low, high) in itertools.product(sizes, [(1, 12), (2, 6)]):
        assert best_grid(height, width, 448, low, high) == get_optimal_tiled_canvas((height, width), (448, 448),
                                                                                   low, high), (height, width)


@pytest.mark.parametrize("width, height", SIZES)
@pytest.mark.parametrize("low, high", [(1, 12), (1, 1), (1, 6), (2, 4), (12, 12)])
def test_image_tiles_and_tokens_from_metadata_equal_the_processors(width, height, low, high):
    rules = InternVL3(InternVL3Config(min_tiles=low, max_tiles=high))
    plan = rules.plan_image(ImageInfo(width, height, "RGB", "PNG"))
    kwargs = {"min_patches": low, "max_patches": high, "crop_to_patches": True}
    tiles = ref.image_processor().get_number_of_image_patches(height, width, kwargs)
    assert plan.num_groups == tiles and plan.thumbnail == (tiles > 1)
    assert (plan.columns, plan.rows) == get_optimal_tiled_canvas((height, width), (448, 448), low, high)
    assert plan.num_tokens == 256 * tiles and plan.grid_thw == (tiles, 32, 32) and plan.patches_per_group == 1024


@pytest.mark.parametrize("width, height", SIZES)
@pytest.mark.parametrize("options, kwargs", [
    (MediaOptions(min_tiles=2), {"min_patches": 2}),
    (MediaOptions(min_tiles=5, max_tiles=30), {"min_patches": 5, "max_patches": 30}),
    (MediaOptions(min_tiles=12), {"min_patches": 12}),
    (MediaOptions(dynamic_image_size=True, min_tiles=3), {"crop_to_patches": True, "min_patches": 3}),
    (MediaOptions(dynamic_image_size=False), {"crop_to_patches": False}),
    # false wins over any tiles, a min above the max too (vLLM's resolve_internvl_min_max_num; the processor's 1)
    (MediaOptions(dynamic_image_size=False, min_tiles=6, max_tiles=3),
     {"crop_to_patches": False, "min_patches": 6, "max_patches": 3}),
], ids=["min2", "min5-max30", "min12", "dynamic-min3", "not-dynamic", "not-dynamic-min6-max3"])
def test_a_requests_tile_settings_give_the_processors_tiles_and_tokens(width, height, options, kwargs):
    """A request's min_tiles / max_tiles / dynamic_image_size as the processor's min_patches / max_patches /
    crop_to_patches (GotOcr2ImageProcessor.get_number_of_image_patches, InternVLProcessor's token count)."""
    plan = INTERNVL.plan_image(ImageInfo(width, height, "RGB", "PNG"), options)
    tiles = ref.image_processor().get_number_of_image_patches(height, width, kwargs)
    assert plan.num_groups == tiles and plan.thumbnail == (tiles > 1) and plan.num_tokens == 256 * tiles
    if options.dynamic_image_size is not False:
        grid = get_optimal_tiled_canvas((height, width), (448, 448), options.min_tiles, options.max_tiles or 12)
        assert (plan.columns, plan.rows) == grid


def test_image_tokens_equal_the_processors_count():
    processor = ref.processor()
    plans = [INTERNVL.plan_image(ImageInfo(w, h, "RGB", "PNG")) for w, h in SIZES]
    counted = processor._get_num_multimodal_tokens(image_sizes=[(h, w) for w, h in SIZES])
    assert counted.num_image_tokens == [2 + p.num_tokens for p in plans]  # + <img> and </img>


def test_max_tiles_option_sets_the_tile_count_either_way():
    info = ImageInfo(1920, 1080, "RGB", "PNG")
    assert INTERNVL.plan_image(info).num_groups == 9  # 4 x 2 (2:1 is closest to 16:9) + thumbnail
    assert INTERNVL.plan_image(info, MediaOptions(max_tiles=2)).num_groups == 3
    assert INTERNVL.plan_image(info, MediaOptions(max_tiles=1)).num_groups == 1
    big = ImageInfo(7000, 7000, "RGB", "PNG")  # above the checkpoint's 12, as transformers' max_patches
    assert INTERNVL.plan_image(big, MediaOptions(max_tiles=40)).num_groups == 37  # 6 x 6 + thumbnail


@pytest.mark.parametrize("total, frames", [(1, 1), (8, 8), (9, 8), (10, 3), (25, 8), (250, 8), (250, 32), (3600, 32),
                                           (1801, 7), (100, 1), (7, 2)])
def test_segments_are_the_processors(total, frames):
    metadata = VideoMetadata(total_num_frames=total, fps=25)
    expected = ref.video_processor().sample_frames(metadata, num_frames=frames).tolist()
    assert segment_indices(total, frames) == expected


@pytest.mark.parametrize("fps, video_fps, total", [(1.0, 25, 250), (2.0, 30, 95), (0.5, 24, 240), (4.0, 29.97, 300)])
def test_fps_sampling_is_the_processors(tmp_path, fps, video_fps, total):
    path = make_video(tmp_path / "clip.mp4", 64, 48, total, video_fps)
    info = probe_video(path)
    plan = INTERNVL.plan_video(info, MediaOptions(fps=fps))
    metadata = VideoMetadata(total_num_frames=info.num_frames, fps=info.fps)
    assert list(plan.frame_indices) == ref.video_processor().sample_frames(metadata, fps=fps).tolist()


@pytest.mark.parametrize("frames, fps, options", [
    (40, 25, MediaOptions()), (40, 25, MediaOptions(num_frames=5)), (9, 30, MediaOptions(num_frames=9, fps=1.0)),
    (1, 25, MediaOptions(num_frames=1)),
])
def test_video_plan_from_metadata(tmp_path, frames, fps, options):
    path = make_video(tmp_path / "clip.mp4", 96, 64, frames, fps)
    info = probe_video(path)
    plan = INTERNVL.plan_video(info, options)
    count = options.num_frames or INTERNVL.config.num_frames  # num_frames wins over fps, as in the processor
    assert plan.frame_indices == tuple(segment_indices(info.num_frames, count)) and plan.num_groups == count
    assert plan.grid_thw == (count, 32, 32) and plan.num_tokens == 256 * count
    assert plan.frame_times_s == tuple(info.frame_pts_s[i] - info.frame_pts_s[0] for i in plan.frame_indices)


def test_a_video_plans_later_groups_alone_are_its_later_frames(tmp_path):
    """What flashcodec decodes of a video whose first groups are in the prefix cache (orchestrator.engine)."""
    plan = INTERNVL.plan_video(probe_video(make_video(tmp_path / "clip.mp4", 96, 64, 40, 25)), MediaOptions())
    tail = INTERNVL.video_groups_from(plan, 3)
    assert tail.frame_indices == plan.frame_indices[3:] and tail.frame_times_s == plan.frame_times_s[3:]
    assert tail.num_groups == plan.num_groups - 3 and tail.grid_thw == (plan.num_groups - 3, 32, 32)
    assert INTERNVL.video_groups_from(plan, 0) == plan
    for first in (-1, plan.num_groups):
        with pytest.raises(ValueError, match="is not one of the plan's"):
            INTERNVL.video_groups_from(plan, first)


@pytest.mark.parametrize("frames", [1, 3, 8])
def test_prompt_text_is_the_processors(frames):
    processor = ref.processor()
    image = INTERNVL.expand("image", (frames, 32, 32))
    video = INTERNVL.expand("video", (frames, 32, 32))
    written = [e.text.replace(e.token, "{}").format(*(e.token * n for n in e.runs)) for e in (image, video)]
    assert written[0] == processor.replace_image_token({"num_patches": [frames]}, 0)
    assert written[1] == processor.replace_video_token({"pixel_values_videos": torch.zeros(1, frames, 1)}, 0)


def test_bad_input_is_refused_with_its_name(tmp_path):
    with pytest.raises(MediaError, match="image: 0x5 has no pixels"):
        INTERNVL.plan_image(ImageInfo(0, 5, "RGB", "PNG"))
    short = probe_video(make_video(tmp_path / "short.mp4", 64, 48, 5, 25))
    # fewer frames than segments (the processor refuses; case C3): every frame, as vLLM's loader takes them
    for options in (MediaOptions(), MediaOptions(fps=30.0), MediaOptions(num_frames=1024)):  # 8, int(5/25*30)=6
        assert INTERNVL.plan_video(short, options).frame_indices == (0, 1, 2, 3, 4)
    assert INTERNVL.plan_video(short, MediaOptions(fps=0.1)).frame_indices == (2,)  # int(5 / 25 * 0.1) = 0: one
    with pytest.raises(ValueError, match="max_pixels does not apply to InternVL3"):
        INTERNVL.plan_image(ImageInfo(64, 64, "RGB", "PNG"), MediaOptions(max_pixels=50000))
    with pytest.raises(ValueError, match="max_tiles does not apply to InternVL3"):
        INTERNVL.plan_video(short, MediaOptions(max_tiles=2))
    with pytest.raises(ValueError, match="num_frames does not apply to Qwen2.5-VL"):
        family("qwen2_5_vl").plan_video(short, MediaOptions(num_frames=4))
    with pytest.raises(ValueError, match="min_tiles <= max_tiles"):
        INTERNVL.plan_image(ImageInfo(64, 64, "RGB", "PNG"), MediaOptions(max_tiles=0))
    with pytest.raises(ValueError, match=r"^min_tiles 13 and max_tiles 12 \(the checkpoint's\): need 1 <= min_tiles "):
        INTERNVL.plan_image(ImageInfo(64, 64, "RGB", "PNG"), MediaOptions(min_tiles=13))
    with pytest.raises(ValueError, match=r"^min_tiles 5 and max_tiles 4: need 1 <= min_tiles <= max_tiles$"):
        INTERNVL.plan_image(ImageInfo(64, 64, "RGB", "PNG"), MediaOptions(min_tiles=5, max_tiles=4))
    for setting in ({"min_tiles": 2}, {"dynamic_image_size": False}):  # image settings, as max_tiles
        with pytest.raises(ValueError, match=f"{next(iter(setting))} does not apply to InternVL3"):
            INTERNVL.plan_video(short, MediaOptions(**setting))
        with pytest.raises(ValueError, match=f"{next(iter(setting))} does not apply to Qwen2.5-VL"):
            family("qwen2_5_vl").plan_image(ImageInfo(64, 64, "RGB", "PNG"), MediaOptions(**setting))
    with pytest.raises(ValueError, match="num_frames must be >= 1"):
        INTERNVL.plan_video(short, MediaOptions(num_frames=0))
    with pytest.raises(ValueError, match="unknown model family 'llava'"):
        family("llava")


@pytest.mark.parametrize("settings, message", [({"tile_size": 440}, "multiple of patch_size"),
                                               ({"min_tiles": 3, "max_tiles": 2}, "min_tiles <= max_tiles"),
                                               ({"num_frames": 0}, "num_frames must be >= 1")])
def test_config_is_checked(settings, message):
    with pytest.raises(ValueError, match=message):
        InternVL3Config(**settings)
