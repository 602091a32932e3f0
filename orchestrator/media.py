"""Media metadata -> sampling plans, before any frame is decoded (flashcodec's probe + Qwen2.5-VL rules)."""
from __future__ import annotations

from flashcodec.errors import MediaError
from flashcodec.probe import probe_image, probe_video
from flashcodec.sampling import ImagePlan, VideoPlan, plan_image, plan_video
from orchestrator.inputs import MediaInput
from orchestrator.sampling_params import InvalidInput, RequestParams


def plan_media(item: MediaInput, params: RequestParams) -> VideoPlan | ImagePlan:
    """Probe one item (a demux pass for video, the header for images) and plan its sampling and size.

    Raises InvalidInput naming the item when it is not a decodable image/video or its size is out of range.
    """
    try:
        if item.kind == "video":
            return plan_video(probe_video(item.source), fps=params.fps, max_pixels=params.max_pixels)
        data = item.data if item.path is None else open(item.path, "rb").read()
        return plan_image(probe_image(data), max_pixels=params.max_pixels)
    except MediaError as exc:
        raise InvalidInput(str(exc)) from None
    except ValueError as exc:  # fps / max_pixels out of range for this item
        raise InvalidInput(f"{item.kind}: {exc}") from None
