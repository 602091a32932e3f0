"""The error type FlashCodec raises for bad media, and its case for an image too large to open."""
from PIL import Image

# The image formats served (Pillow's names): raster formats that Pillow decodes itself. Any other plugin is never
# tried: Pillow's EPS plugin runs Ghostscript (`gs`, where the host has one) on the client's PostScript at decode
# (a fresh user's break test, 2026-12-07: its errors were 500s naming temporary files, and a render that never ends
# held a flashcodec decode thread until it did).
IMAGE_FORMATS = ("JPEG", "MPO", "PNG", "WEBP", "GIF", "BMP", "TIFF", "AVIF", "ICO", "PPM")
# What Pillow cannot identify among them (its own message is a Python repr of the BytesIO it was given).
NOT_AN_IMAGE = "image: not a decodable image (JPEG, PNG, WebP, GIF, BMP, TIFF, AVIF, ICO or PPM)"


class MediaError(ValueError):
    """Input media that cannot be used: not decodable, truncated/corrupt beyond use, unsupported, or out of limits.

    The message starts with the kind of media ("video: ...", "image: ...") and names the property at fault, so
    the Triton boundary can pass it to the client unchanged as an INVALID_ARGUMENT error.
    """


class TooManyPixels(MediaError):
    """An image whose header gives more pixels than Pillow opens: ``more_than``, twice ``PIL.Image.MAX_IMAGE_PIXELS``
    (178,956,970 by default; Pillow's ``DecompressionBombError``); the server's own cap may be lower
    (``orchestrator.media.probe_media``)."""

    def __init__(self):
        self.more_than = 2 * Image.MAX_IMAGE_PIXELS
        super().__init__(f"image: more than {self.more_than} pixels by its header, over Pillow's decompression-bomb "
                         "limit: downscale it first")
