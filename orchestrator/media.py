"""Media metadata -> sampling plans, before any frame is decoded (flashcodec's probe + Qwen2.5-VL rules)."""
from __future__ import annotations

from flashcodec.errors import MediaError
from flashcodec.probe import probe_image, probe_video
from flashcodec.sampling import ImagePlan, VideoPlan, plan_image, plan_video
from orchestrator.inputs import MediaInput
from orchestrator.sampling_params import InvalidInput, RequestParams


def plan_media(item: MediaInput, params: RequestParams, max_image_pixels: int | None = None) -> VideoPlan | ImagePlan:
    """Probe one item (a demux pass for video, the header for images) and plan its sampling and size.

    Raises InvalidInput naming the input the item came from (``image_url: not a decodable image ...``)
    when it is not a decodable image/video, or an image has more than ``max_image_pixels`` pixels (None: no cap
    but Pillow's own), or naming the sampling parameter that is out of range for it.
    """
    try:
        if item.kind == "video":
            return plan_video(probe_video(item.source), fps=params.fps, max_pixels=params.max_pixels)
        # from a path, the header only: a large file named by image_url is not read whole to be refused
        info = probe_image(item.source)
        if max_image_pixels is not None and info.width * info.height > max_image_pixels:
            raise InvalidInput(f"{item.input_name}: {info.width}x{info.height} is {info.width * info.height} pixels, "
                               f"over the limit of {max_image_pixels} (parameter max_image_pixels): downscale it first")
        return plan_image(info, max_pixels=params.max_pixels)
    except MediaError as exc:
        # flashcodec names the media kind; the client needs the input it used ("image_url", not "image").
        message = str(exc).removeprefix(f"{item.kind}: ")
        raise InvalidInput(f"{item.input_name}: {message}") from None
    except ValueError as exc:  # fps / max_pixels out of range for this item (the message names the key)
        raise InvalidInput(f"sampling_parameters: {exc}") from None
