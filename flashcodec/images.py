"""Image bytes -> one upright 8-bit RGB Pillow image, before any geometry (case C2)."""
from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from flashcodec.errors import NOT_AN_IMAGE, MediaError, TooManyPixels
from flashcodec.probe import exif_orientation, image_formats

BACKGROUND = (255, 255, 255)  # transparent areas are composited over white, as qwen-vl-utils `to_rgb` does
_SIXTEEN_BIT = {"I;16", "I;16L", "I;16B", "I;16N", "I"}


def to_rgb(img: Image.Image) -> Image.Image:
    """Convert any Pillow mode to 8-bit RGB.

    * Alpha (RGBA, LA, PA, P or L with a transparent index): alpha over BACKGROUND, through `Image.paste` with the
      alpha as mask, exactly qwen-vl-utils `to_rgb` for RGBA (transformers' `convert_to_rgb` would drop alpha).
    * 16-bit greyscale (I;16*, and I, which Pillow uses for 16-bit PNG/TIFF): 0..65535 scaled to 0..255 (x >> 8);
      Pillow's own conversion clips at 255 instead.
    * Everything else (1, L, P, CMYK, YCbCr, LAB, HSV, ...): Pillow's `convert("RGB")`.
    """
    if img.mode == "RGB":
        return img
    if img.mode in _SIXTEEN_BIT:
        grey = np.asarray(img).astype(np.int64) >> 8
        return Image.fromarray(np.clip(grey, 0, 255).astype(np.uint8)).convert("RGB")  # 2-D uint8: mode L
    if img.mode in ("RGBA", "LA", "PA", "La", "RGBa") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        out = Image.new("RGB", rgba.size, BACKGROUND)
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    return img.convert("RGB")


def load_image(data: bytes) -> Image.Image:
    """Decode image bytes to an upright 8-bit RGB Pillow image: EXIF orientation applied
    (`PIL.ImageOps.exif_transpose`, as vLLM's image loader does: a phone photo stored on its side comes out
    upright) when the header has one (`probe.exif_orientation`: the size the probe counted tokens for), then `to_rgb`.

    Multi-frame files (animated GIF/WebP/PNG, multi-page TIFF): the first frame only. Raises MediaError if the
    bytes are not an image of `probe.image_formats` that Pillow can decode, are truncated, or exceed Pillow's
    decompression-bomb pixel limit.
    """
    try:
        with Image.open(io.BytesIO(data), formats=image_formats()) as img:
            img.seek(0)
            orientation = exif_orientation(img)
            img.load()
            return to_rgb(ImageOps.exif_transpose(img) if orientation != 1 else img).copy()
    except Image.DecompressionBombError as exc:
        raise TooManyPixels() from exc
    except UnidentifiedImageError as exc:
        raise MediaError(NOT_AN_IMAGE) from exc
    except (OSError, SyntaxError, ValueError) as exc:
        raise MediaError(f"image: truncated or corrupt ({exc})") from exc
