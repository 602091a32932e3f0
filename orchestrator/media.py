"""Media metadata -> sampling plans, before any frame is decoded (flashcodec's probe + the served family's rules,
``flashcodec.families``)."""
from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import fields, replace

from PIL import Image

from flashcodec.errors import MediaError, TooManyPixels
from flashcodec.families import Family, MediaOptions, MediaPlan
from flashcodec.families.cap import plan_tokens
from flashcodec.files import changed_since
from flashcodec.probe import ImageInfo, VideoInfo, probe_image, probe_video
from orchestrator.inputs import MediaInput
from orchestrator.media_identity import file_key
from orchestrator.sampling_params import InvalidInput, RequestParams, parse_sampling_parameters
from orchestrator.visual_cap import CapApplied, fit_visual_tokens

# Pillow warns as it opens the header of an image of more than its MAX_IMAGE_PIXELS (and refuses one of twice that:
# TooManyPixels). This process reads images' headers only, never their pixels, and refuses one over max_image_pixels
# from the same header (probe_media): here the warning would only add a traceback-like line to the server's log.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)

PROBED_VIDEOS = 256  # video files whose probe is kept (a probe holds each frame's timestamp: 8 bytes a frame)
MEDIA_SETTINGS = tuple(f.name for f in fields(MediaOptions))  # the sampling_parameters keys a family may take


@contextlib.contextmanager
def _named(item: MediaInput):
    """flashcodec's errors as InvalidInput naming the input the item came from (``image_url``, not ``image``), told
    as the file's change where the file is no longer the one the request's check saw (``flashcodec.files.
    changed_since``: a file truncated while it was probed failed to open, or to seek: a fresh user's test), and a
    sampling value out of range for it as naming ``sampling_parameters``."""
    try:
        yield
    except MediaError as exc:
        message = str(exc)
        if item.stamp is not None:  # a path's, as checked
            message = changed_since(item.path, item.stamp, item.kind) or message
        raise InvalidInput(f"{item.input_name}: {message.removeprefix(f'{item.kind}: ')}") from None
    except ValueError as exc:  # a media setting out of range for this item (the message names the key)
        raise InvalidInput(f"sampling_parameters: {exc}") from None


def probe_media(item: MediaInput, max_image_pixels: int | None = None) -> VideoInfo | ImageInfo:
    """Probe one item: a demux pass for a video, the header for an image (from a path, only the header is read, so a
    large file named by image_url is not read whole to be refused).

    Raises InvalidInput naming the item's input when it is not a decodable image/video, or an image has more than
    ``max_image_pixels`` pixels (None: no cap but Pillow's own).
    """
    with _named(item):
        if item.kind == "video" and item.path is not None:
            return _probe_video_file(*file_key(item))
        if item.kind == "video":
            return probe_video(item.data)
        try:
            info = probe_image(item.source)
        except TooManyPixels as exc:  # Pillow's limit, met before ours is checked
            if max_image_pixels is None or max_image_pixels >= exc.more_than:
                raise
            raise MediaError(_over_cap(f"more than {exc.more_than} pixels by its header", max_image_pixels)) from None
    if max_image_pixels is not None and info.width * info.height > max_image_pixels:
        raise InvalidInput(f"{item.input_name}: " + _over_cap(
            f"{info.width}x{info.height} is {info.width * info.height} pixels", max_image_pixels))
    return info


def _over_cap(size: str, max_image_pixels: int) -> str:
    return f"{size}, over the limit of {max_image_pixels} (parameter max_image_pixels): downscale it first"


@functools.lru_cache(maxsize=PROBED_VIDEOS)
def _probe_video_file(path: str, *content: int) -> VideoInfo:
    """A video file's probe, kept for the next requests about the same file (``content``: the rest of its
    ``file_key``, so a file rewritten or replaced is probed again; a follow-up question skips the demux pass: about
    80 ms for a 3-minute 720p video on the H200 machine). Errors are not kept."""
    return probe_video(path)


def check_media_settings(params: RequestParams, family: Family) -> None:
    """Raises InvalidInput naming the first media setting of ``params`` (``MEDIA_SETTINGS``: ``fps``, ``max_pixels``,
    ``min_pixels``, ``num_frames``, ``max_tiles``, ``min_tiles``, ``dynamic_image_size``) that ``family`` does not take
    (``Family.options``), with or without media in the request."""
    try:
        params.media.refuse(f"the served model family {family.name}",
                            *(name for name in MEDIA_SETTINGS if name not in family.options))
    except ValueError as exc:
        raise InvalidInput(f"sampling_parameters: {exc}") from None


def media_defaults(text: str | None, family: Family) -> RequestParams:
    """The server's media settings (the orchestrator's ``media_defaults`` parameter, a JSON object like
    ``{"num_frames": 32}``; vLLM's ``--mm-processor-kwargs`` for these keys), which a request's own settings override.
    Raises ValueError naming the parameter for a key other than ``MEDIA_SETTINGS`` (and their aliases; the message
    lists those), a bad value (the request rules of ``parse_sampling_parameters``), a setting ``family`` does not
    take, or settings that ``family`` cannot plan a plain image or video with (``min_pixels`` above ``max_pixels``, a
    ``max_pixels`` under a video frame's minimum): every media request would be refused, blaming its client."""
    try:
        defaults = parse_sampling_parameters(text, MEDIA_SETTINGS)
        check_media_settings(defaults, family)
    except InvalidInput as exc:
        raise ValueError(f"parameter media_defaults: {str(exc).removeprefix('sampling_parameters: ')}") from None
    video = VideoInfo(640, 480, 640, 480, 0, 30.0, 300, 10.0, "h264", tuple(i / 30 for i in range(300)), False)
    try:
        family.plan_image(ImageInfo(640, 480, "RGB", "PNG"), defaults.media.for_kind("image"))
        family.plan_video(video, defaults.media.for_kind("video"))
    except (ValueError, MediaError) as exc:
        raise ValueError(f"parameter media_defaults: {exc}") from None
    return defaults


def with_media_defaults(params: RequestParams, defaults: RequestParams, family: Family) -> RequestParams:
    """``params`` with the media settings it leaves unset (None) taken from ``defaults`` (:func:`media_defaults`):
    a request's own setting, then the server's, then (None) the family's. ``family.frame_settings`` choose one
    thing, a video's frames: a request that sets one of them takes none of them from ``defaults`` (InternVL3: a
    request's fps is not overridden by the server's num_frames; ``family.plan_video`` follows the request's first).
    So do ``family.size_settings``, an item's size: a request's max_pixels is not held below the server's
    min_pixels, nor its max_tiles below the server's min_tiles."""
    given = {key for key in MEDIA_SETTINGS if getattr(params, key) is not None}
    for linked in (set(family.frame_settings), set(family.size_settings)):
        if given & linked:
            given |= linked
    unset = {key: getattr(defaults, key) for key in MEDIA_SETTINGS
             if key not in given and getattr(defaults, key) is not None}
    return replace(params, **unset) if unset else params


def plan_probed(item: MediaInput, info: VideoInfo | ImageInfo, family: Family, options: MediaOptions) -> MediaPlan:
    """The frames or tiles and sizes of a probed item by ``family``'s rules and ``options`` (the request's media
    settings: ``MediaOptions.for_kind`` keeps those about the item's kind). Raises InvalidInput naming the input (an
    aspect ratio over 200, a zero-size image, a video shorter than its segments) or the sampling parameter out of
    range for it."""
    with _named(item):
        if isinstance(info, VideoInfo):
            return family.plan_video(info, options.for_kind("video"))
        return family.plan_image(info, options.for_kind("image"))


def plan_media(item: MediaInput, params: RequestParams, family: Family, max_image_pixels: int | None = None
               ) -> MediaPlan:
    """:func:`probe_media`, then :func:`plan_probed` with ``params``' media settings; raises as they do."""
    return plan_probed(item, probe_media(item, max_image_pixels), family, params.media)


def plan_request(items: list[MediaInput], infos: list[VideoInfo | ImageInfo], params: RequestParams, family: Family,
                 max_visual_tokens: int) -> tuple[list[MediaPlan], CapApplied | None]:
    """Every probed item's plan (:func:`plan_probed`); when their visual tokens exceed ``max_visual_tokens`` (0: no
    cap), the plans lowered to fit it and what was changed (``orchestrator.visual_cap``), else None. Raises
    InvalidInput as :func:`check_media_settings` and :func:`plan_probed`, or naming ``max_visual_tokens`` when even
    the lowest plans exceed it."""
    check_media_settings(params, family)
    plans = [plan_probed(item, info, family, params.media) for item, info in zip(items, infos)]
    if not max_visual_tokens or sum(map(plan_tokens, plans)) <= max_visual_tokens:
        return plans, None
    return fit_visual_tokens(family, infos, params.media, max_visual_tokens)


def media_report(infos: list[VideoInfo | ImageInfo], plans: list[MediaPlan]) -> list[dict]:
    """What was done with each media item (the ``media`` output of a request's first response): one JSON object an
    item, in the request's media order, from its probe (``infos``) and its plan (``plans``: :func:`plan_request`'s,
    after any visual-token cap). Any family's plans (Qwen2.5-VL's, InternVL3's): their common fields only.

    Every item: ``kind`` ("image" or "video"); ``grid_thw`` [t, h, w], the plan's grid (Qwen2.5-VL: 14-px patches,
    t = sampled frames / 2; InternVL3: tiles or frames, 32, 32); ``visual_tokens``, the LLM tokens it takes
    (``plan_tokens``). An image: ``width``, ``height``, its pixels as displayed (``ImageInfo``, from its header).
    A video: ``width``, ``height``, its frames as displayed (``VideoInfo``: after its rotation);
    ``frames_in_file`` (``VideoInfo.num_frames``); ``duration_s``, seconds to the millisecond
    (``VideoInfo.duration_s``); ``frames``, the file's distinct frames used; ``sampled_frames``, the frames the model
    sees, repeats counted (Qwen2.5-VL's temporal patch of 2 takes a 1-frame clip's frame twice: frames 1,
    sampled_frames 2); ``fps``, the sample's frames per second to 1/1000, under that to 3 significant digits (not
    0.0; Qwen2.5-VL's ``sampled_fps``), null where the family samples by segments (InternVL3); and where the file
    was cut short after its index (``VideoInfo.truncated``: its frames up to the cut are used) ``truncated`` true and
    ``frames_declared``, the frames its index declares. Raises ValueError when ``infos`` and ``plans`` differ in
    length."""
    report = []
    for info, plan in zip(infos, plans, strict=True):
        item = {"kind": plan.kind, "grid_thw": list(plan.grid_thw), "visual_tokens": plan_tokens(plan)}
        if isinstance(info, VideoInfo):
            fps = getattr(plan, "sampled_fps", None)
            item.update(width=info.width, height=info.height, frames_in_file=info.num_frames,
                        duration_s=round(info.duration_s, 3),
                        frames=len(set(plan.frame_indices)), sampled_frames=len(plan.frame_indices),
                        fps=None if fps is None else round(fps, 3) or float(f"{fps:.3g}"))
            if info.truncated:
                item.update(truncated=True, frames_declared=info.declared_frames)
        else:
            item.update(width=info.width, height=info.height)
        report.append(item)
    return report
