"""What the first response says was done with each media item (orchestrator/media.py ``media_report``): any family's
plans, from their common fields; a clip with fewer frames than the sampler wants reports the frames it really has
(case C3); a file cut short after its index says so (case C4)."""
import dataclasses

import pytest

from flashcodec.families import MediaOptions, family
from flashcodec.families.cap import plan_all
from flashcodec.probe import ImageInfo
from orchestrator.media import media_report
from tests.unit.flashcodec.test_sampling import cfr_info

QWEN, INTERNVL = family("qwen2_5_vl"), family("internvl3")


def report(served, *infos) -> list[dict]:
    """``infos`` planned by ``served``'s rules at its defaults, reported."""
    return media_report(list(infos), plan_all(served, list(infos), [MediaOptions()] * len(infos)))


def test_a_qwen_image_reports_its_size_grid_and_tokens():
    assert report(QWEN, ImageInfo(1000, 500, "RGB", "PNG")) == [
        {"kind": "image", "grid_thw": [1, 36, 72], "visual_tokens": 648, "width": 1000, "height": 500}]


def test_a_one_frame_clip_reports_one_frame_seen_twice():
    """Qwen2.5-VL's temporal patch of 2: the only frame is repeated (sampled_frames 2), but the file has one."""
    assert report(QWEN, cfr_info(64, 48, 1, 10.0)) == [
        {"kind": "video", "grid_thw": [1, 20, 28], "visual_tokens": 140, "width": 64, "height": 48,
         "frames_in_file": 1, "duration_s": 0.1,
         "frames": 1, "sampled_frames": 2, "fps": 20.0}]


@pytest.mark.parametrize("num_frames, used, duration_s, fps", [(2, 2, 0.2, 10.0), (3, 2, 0.3, 6.667),
                                                                 (26, 4, 2.6, 1.538)])
def test_short_clips_report_their_real_frames(num_frames, used, duration_s, fps):
    """Fewer frames than 2 fps wants (qwen-vl-utils' 4 at least): what exists is sampled, down to a multiple of 2."""
    (item,) = report(QWEN, cfr_info(64, 48, num_frames, 10.0))
    assert item["frames_in_file"] == num_frames and item["frames"] == item["sampled_frames"] == used
    assert (item["duration_s"], item["fps"], item["grid_thw"][0]) == (duration_s, fps, used // 2)
    assert item["visual_tokens"] == used // 2 * 140


def test_a_truncated_file_says_so_with_the_frames_its_index_declares():
    """A file cut short after its index (case C4): its frames up to the cut are used, and the report says it was
    truncated; a whole file's report has neither field."""
    (item,) = report(QWEN, dataclasses.replace(cfr_info(64, 48, 26, 10.0), declared_frames=60))
    assert (item["frames_in_file"], item["truncated"], item["frames_declared"]) == (26, True, 60)
    assert "truncated" not in report(QWEN, dataclasses.replace(cfr_info(64, 48, 26, 10.0), declared_frames=26))[0]


def test_internvl3_plans_report_the_same_fields_and_no_fps_in_the_requests_order():
    """Segments, not a rate: fps is null; an image's grid counts its tiles (2 and the thumbnail)."""
    video, image = report(INTERNVL, cfr_info(640, 360, 300, 30.0), ImageInfo(1000, 500, "RGB", "PNG"))
    assert video == {"kind": "video", "grid_thw": [8, 32, 32], "visual_tokens": 2048, "width": 640, "height": 360,
                     "frames_in_file": 300,
                     "duration_s": 10.0, "frames": 8, "sampled_frames": 8, "fps": None}
    assert image == {"kind": "image", "grid_thw": [3, 32, 32], "visual_tokens": 768, "width": 1000, "height": 500}


def test_every_item_needs_its_plan():
    with pytest.raises(ValueError):
        media_report([cfr_info(64, 48, 1, 10.0)], [])


def test_a_sparse_clips_rate_keeps_three_significant_digits_instead_of_rounding_to_zero():
    (item,) = report(QWEN, cfr_info(64, 48, 4, 0.0002))  # a frame every 5,000 s
    assert item["fps"] == 0.0002 and item["frames"] == 4


def test_a_turned_videos_size_is_its_upright_one():
    """A phone's portrait clip stored landscape with a 90-degree display matrix (case C5): the size it is shown at."""
    turned = dataclasses.replace(cfr_info(640, 360, 30, 30.0), width=360, height=640, rotation=90)
    (item,) = report(QWEN, turned)
    assert (item["width"], item["height"]) == (360, 640) and item["grid_thw"][1] > item["grid_thw"][2]
