"""A request's visual tokens within a cap (``max_visual_tokens``): its videos' fps lowered first, then every item's
pixels, all from metadata before any frame is decoded, instead of refusing the request.

The order follows the design card's advice for 4K and long streams (fewer frames before smaller frames: a
frame's detail matters more to a question than the count of near-identical frames). Both are searched by
bisection over Qwen2.5-VL's own sampling rules (``flashcodec.sampling``): a video keeps at least its
``FPS_MIN_FRAMES`` frames and ``VIDEO_MIN_PIXELS`` per frame, an image ``IMAGE_MIN_PIXELS``; the request's own
``fps`` and ``max_pixels`` stay upper bounds. Pure: no I/O, no torch at import.
"""
from __future__ import annotations

from dataclasses import dataclass

from flashcodec.probe import ImageInfo, VideoInfo
from flashcodec.sampling import (IMAGE_MIN_PIXELS, VIDEO_MIN_PIXELS, ImagePlan, VideoPlan, plan_image,
                                 plan_video)
from orchestrator.sampling_params import InvalidInput

_STEPS = 24  # bisection steps: fps and pixel scale to within 2**-24 of the best that fits

Info = VideoInfo | ImageInfo
Plan = VideoPlan | ImagePlan


@dataclass(frozen=True)
class CapApplied:
    """What the cap changed in a request: ``requested``/``visual_tokens`` its visual tokens before and after
    (tokens), ``cap`` the limit, ``fps`` the videos' sampling rate now (frames per second; None: unchanged),
    ``max_pixels`` each item's pixel cap now, in the request's media order (None: unchanged)."""

    cap: int
    requested: int
    visual_tokens: int
    fps: float | None
    max_pixels: tuple[int | None, ...]

    def to_json(self) -> dict:
        return {"max_visual_tokens": self.cap, "requested_visual_tokens": self.requested,
                "visual_tokens": self.visual_tokens, "fps": self.fps, "max_pixels": list(self.max_pixels)}


def plan_tokens(plan: Plan) -> int:
    """The LLM tokens of one plan (visual tokens after the 2x2 merge)."""
    return plan.num_groups * plan.tokens_per_group


def _plan(info: Info, fps: float, max_pixels: int | None) -> Plan:
    if isinstance(info, VideoInfo):
        return plan_video(info, fps=fps, max_pixels=max_pixels)
    return plan_image(info, max_pixels=max_pixels)


def _plans(infos: list[Info], fps: float, max_pixels: list[int | None]) -> list[Plan]:
    return [_plan(info, fps, px) for info, px in zip(infos, max_pixels)]


def _total(plans: list[Plan]) -> int:
    return sum(map(plan_tokens, plans))


def fit_visual_tokens(infos: list[Info], fps: float, max_pixels: int | None, cap: int | None
                      ) -> tuple[list[Plan], CapApplied | None]:
    """Plans for ``infos`` (the request's media, in order) with ``fps`` (frames per second) and ``max_pixels``
    (pixels, None: the model's defaults), lowered until their visual tokens are at most ``cap`` (None: no cap).

    First one fps for every video, the highest that fits (bisection in (0, ``fps``]); at the lowest (each video at
    its minimum frame count) still over, then one scale s in (0, 1] of every item's resized area, the highest that
    fits (each item's ``max_pixels`` = s x its area at that fps, at least its kind's minimum). Returns the plans and
    what was changed (None when the request fits as sent). Raises InvalidInput naming ``max_visual_tokens`` when
    even the lowest fps and pixels exceed it; ValueError / MediaError as ``plan_video`` / ``plan_image``.
    """
    requested = [max_pixels] * len(infos)
    plans = _plans(infos, fps, requested)
    before = _total(plans)
    if cap is None or before <= cap:
        return plans, None
    has_video = any(isinstance(info, VideoInfo) for info in infos)
    lowest_fps = fps * 2.0 ** -_STEPS  # below any clip's minimum frame count: smart_nframes' floor applies
    new_fps = fps
    if has_video:
        fewest = _total(_plans(infos, lowest_fps, requested))  # every video at its fewest frames
        # the highest fps that fits, or (none fits) the highest that still gives the fewest frames
        new_fps = _highest(lambda f: _total(_plans(infos, f, requested)) <= max(cap, fewest), lowest_fps, fps)
        plans = _plans(infos, new_fps, requested)
    if _total(plans) > cap:
        areas = [p.resized_height * p.resized_width for p in plans]
        floors = [VIDEO_MIN_PIXELS if isinstance(i, VideoInfo) else IMAGE_MIN_PIXELS for i in infos]

        def scaled(s: float) -> list[int]:
            return [max(int(floor), int(s * area)) for floor, area in zip(floors, areas)]

        smallest = _plans(infos, new_fps, scaled(0.0))
        if _total(smallest) > cap:
            raise InvalidInput(
                f"image and video inputs: the request's media need at least {_total(smallest)} visual tokens at the "
                f"lowest fps and pixels, over max_visual_tokens {cap} (the server's limit): send fewer or shorter "
                "images and videos")
        scale = _highest(lambda s: _total(_plans(infos, new_fps, scaled(s))) <= cap, 0.0, 1.0)
        pixels = scaled(scale)
        plans = _plans(infos, new_fps, pixels)
    else:
        pixels = [None] * len(infos)
    return plans, CapApplied(cap, before, _total(plans), new_fps if has_video and new_fps != fps else None,
                             tuple(pixels))


def _highest(fits, low: float, high: float) -> float:
    """The highest x in [low, high] with ``fits(x)`` (``fits`` monotone: true at low), to within 2**-24 of the
    range."""
    if fits(high):
        return high
    for _ in range(_STEPS):
        middle = (low + high) / 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low
