"""The one error type FlashCodec raises for bad media."""

# What Pillow cannot identify (its own message is a Python repr of the BytesIO it was given).
NOT_AN_IMAGE = "image: not a decodable image (JPEG, PNG, WebP, ...)"


class MediaError(ValueError):
    """Input media that cannot be used: not decodable, truncated/corrupt beyond use, unsupported, or out of limits.

    The message starts with the kind of media ("video: ...", "image: ...") and names the property at fault, so
    the Triton boundary can pass it to the client unchanged as an INVALID_ARGUMENT error.
    """
