"""Images upright: an image stored on its side with an EXIF orientation gives the visual tokens and the patches of
the same picture stored upright (probe and decode agree; vLLM applies the orientation likewise)."""
import io

import numpy as np
import pytest
import torch
from PIL import ExifTags, Image

from flashcodec.images import load_image
from flashcodec.pipeline import image_group
from flashcodec.probe import probe_image
from flashcodec.sampling import plan_image
from tests.media import gradient

# EXIF orientation -> np.rot90 turns (counter-clockwise) of the upright picture that the file stores: orientation 6
# ("row 0 is the visual right side") is displayed by turning the stored pixels 90 degrees clockwise, 8 by turning
# them 90 degrees counter-clockwise, 3 by turning them 180 degrees (EXIF 2.3, tag 0x0112).
STORED_TURNS = {6: 1, 8: -1, 3: 2}


def encode(pixels: np.ndarray, fmt: str, orientation: int | None = None) -> bytes:
    exif = Image.Exif()
    if orientation is not None:
        exif[ExifTags.Base.Orientation] = orientation
    out = io.BytesIO()
    options = {"JPEG": {"quality": 95}, "WEBP": {"lossless": True}}.get(fmt, {})  # WebP: the same pixels back
    Image.fromarray(pixels).save(out, fmt, exif=exif.tobytes(), **options)
    return out.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])  # lossless: both files hold exactly these pixels
@pytest.mark.parametrize("orientation", sorted(STORED_TURNS))
def test_exif_orientation_gives_the_tokens_and_patches_of_the_upright_picture(orientation, fmt):
    upright = gradient(0, 0.0, 200, 300)  # landscape: a turn of 90 degrees changes the token grid
    stored = np.ascontiguousarray(np.rot90(upright, STORED_TURNS[orientation]))
    sideways, plain = encode(stored, fmt, orientation), encode(upright, fmt)
    info = probe_image(sideways)
    assert (info.width, info.height, info.orientation) == (300, 200, orientation)
    plan = plan_image(info)
    assert plan == plan_image(probe_image(plain))
    assert np.array_equal(np.asarray(load_image(sideways)), upright)
    assert torch.equal(image_group(sideways, plan), image_group(plain, plan))


def test_a_jpeg_on_its_side_is_turned_upright_and_probed_upright():
    """A phone photo: JPEG pixels stored sideways with orientation 6 come out as those pixels turned clockwise."""
    stored = np.ascontiguousarray(np.rot90(gradient(0, 0.0, 200, 300), 1))  # 300 rows, 200 columns
    data = encode(stored, "JPEG", 6)
    with Image.open(io.BytesIO(data)) as raw:  # the decoded pixels as stored (Pillow applies no orientation itself)
        as_stored = np.asarray(raw.convert("RGB"))
    assert as_stored.shape == (300, 200, 3)
    assert np.array_equal(np.asarray(load_image(data)), np.rot90(as_stored, -1))
    info = probe_image(data)
    assert (info.width, info.height) == (300, 200)


@pytest.mark.parametrize("orientation", [None, 1, 0, 9])
def test_no_orientation_or_one_outside_1_to_8_leaves_the_image_as_stored(orientation):
    stored = gradient(0, 0.0, 56, 84)
    data = encode(stored, "PNG", orientation)
    info = probe_image(data)
    assert (info.width, info.height, info.orientation) == (84, 56, 1)
    assert np.array_equal(np.asarray(load_image(data)), stored)
