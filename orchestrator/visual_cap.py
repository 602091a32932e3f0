"""A request's visual tokens within a cap (``max_visual_tokens``): its media lowered by the served family's knobs,
all from metadata before any frame is decoded, instead of refusing the request.

Fewer frames before smaller frames (the design card's advice for 4K and long streams: a frame's detail matters more
to a question than the count of near-identical frames). Qwen2.5-VL: one fps for every video, then one scale of
every item's pixels, both searched by bisection over its own sampling rules (``flashcodec.sampling``: a video keeps at
least ``FPS_MIN_FRAMES`` frames and ``VIDEO_MIN_PIXELS`` per frame, an image ``IMAGE_MIN_PIXELS``). InternVL3: one
``num_frames`` for every video (each keeps at most its own), then one ``max_tiles`` for every image, down to one
frame and one tile. The request's own settings stay upper bounds. Pure: no I/O, no torch at import.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from flashcodec.families import Family, MediaOptions, MediaPlan
from flashcodec.probe import ImageInfo, VideoInfo
from flashcodec.sampling import FPS, IMAGE_MIN_PIXELS, VIDEO_MIN_PIXELS
from orchestrator.sampling_params import InvalidInput

_STEPS = 24  # bisection steps: fps and pixel scale to within 2**-24 of the best that fits

Info = VideoInfo | ImageInfo


@dataclass(frozen=True)
class CapApplied:
    """What the cap changed in a request: ``requested``/``visual_tokens`` its visual tokens before and after
    (tokens), ``cap`` the limit; None where unchanged: ``fps`` the videos' sampling rate now (frames per second),
    ``max_pixels`` each item's pixel cap now, in the request's media order (Qwen2.5-VL); ``num_frames`` the most
    frames of a video, ``max_tiles`` the most tiles of an image (InternVL3)."""

    cap: int
    requested: int
    visual_tokens: int
    fps: float | None = None
    max_pixels: tuple[int | None, ...] | None = None
    num_frames: int | None = None
    max_tiles: int | None = None

    def to_json(self) -> dict:
        return {"max_visual_tokens": self.cap, "requested_visual_tokens": self.requested,
                "visual_tokens": self.visual_tokens, "fps": self.fps,
                "max_pixels": None if self.max_pixels is None else list(self.max_pixels),
                "num_frames": self.num_frames, "max_tiles": self.max_tiles}


def plan_tokens(plan: MediaPlan) -> int:
    """The LLM tokens of one plan (visual tokens after the 2x2 merge / pixel shuffle)."""
    return plan.num_groups * plan.tokens_per_group


def _plans(family: Family, infos: list[Info], options: list[MediaOptions]) -> list[MediaPlan]:
    """Each item's plan by its own options (``MediaOptions.for_kind`` keeps those about its kind)."""
    return [family.plan_video(info, o.for_kind("video")) if isinstance(info, VideoInfo) else
            family.plan_image(info, o.for_kind("image")) for info, o in zip(infos, options)]


def _total(plans: list[MediaPlan]) -> int:
    return sum(map(plan_tokens, plans))


def fit_visual_tokens(family: Family, infos: list[Info], options: MediaOptions, cap: int | None
                      ) -> tuple[list[MediaPlan], CapApplied | None]:
    """Plans for ``infos`` (the request's media, in order) by ``family``'s rules with the request's ``options``,
    lowered until their visual tokens are at most ``cap`` (None: no cap), by the family's knobs (module docstring).

    Returns the plans and what was changed (None when the request fits as sent). Raises InvalidInput naming
    ``max_visual_tokens`` when even the lowest settings exceed it; ValueError / MediaError as the family's plans.
    """
    plans = _plans(family, infos, [options] * len(infos))
    before = _total(plans)
    if cap is None or before <= cap:
        return plans, None
    plans, changed = _FITS[family.name](family, infos, options, plans, cap)
    return plans, CapApplied(cap, before, _total(plans), **changed)


def _too_many(infos: list[Info], lowest: int, cap: int, knobs: str) -> InvalidInput:
    """The refusal of media that stay over ``cap`` at the lowest ``knobs``, naming the kinds the request sent."""
    videos = any(isinstance(info, VideoInfo) for info in infos)
    images = any(isinstance(info, ImageInfo) for info in infos)
    inputs, advice = {(True, True): ("image and video inputs", "fewer or shorter images and videos"),
                      (False, True): ("video inputs", "fewer or shorter videos"),
                      (True, False): ("image inputs", "fewer or smaller images")}[images, videos]
    return InvalidInput(f"{inputs}: the request's media need at least {lowest} visual tokens at the lowest {knobs}, "
                        f"over max_visual_tokens {cap} (the server's limit): send {advice}")


def _fps_then_pixels(family: Family, infos: list[Info], options: MediaOptions, plans: list[MediaPlan], cap: int
                     ) -> tuple[list[MediaPlan], dict]:
    """Qwen2.5-VL: first one fps for every video, the highest that fits (bisection in (0, the request's fps]); at the
    lowest (each video at its minimum frame count) still over, then one scale s in (0, 1] of every item's resized
    area, the highest that fits (each item's ``max_pixels`` = s x its area at that fps, at least its kind's
    minimum)."""
    fps = FPS if options.fps is None else options.fps

    def at(f: float, pixels: list[int | None]) -> list[MediaPlan]:
        return _plans(family, infos, [replace(options, fps=f, max_pixels=px) for px in pixels])

    requested = [options.max_pixels] * len(infos)
    has_video = any(isinstance(info, VideoInfo) for info in infos)
    lowest_fps = fps * 2.0 ** -_STEPS  # below any clip's minimum frame count: smart_nframes' floor applies
    new_fps = fps
    if has_video:
        fewest = _total(at(lowest_fps, requested))  # every video at its fewest frames
        # the highest fps that fits, or (none fits) the highest that still gives the fewest frames
        new_fps = _highest(lambda f: _total(at(f, requested)) <= max(cap, fewest), lowest_fps, fps)
        plans = at(new_fps, requested)
    pixels: tuple[int | None, ...] | None = None
    if _total(plans) > cap:
        areas = [p.resized_height * p.resized_width for p in plans]
        floors = [VIDEO_MIN_PIXELS if isinstance(i, VideoInfo) else IMAGE_MIN_PIXELS for i in infos]

        def scaled(s: float) -> list[int]:
            return [max(int(floor), int(s * area)) for floor, area in zip(floors, areas)]

        smallest = at(new_fps, scaled(0.0))
        if _total(smallest) > cap:
            raise _too_many(infos, _total(smallest), cap, "fps and pixels")
        pixels = tuple(scaled(_highest(lambda s: _total(at(new_fps, scaled(s))) <= cap, 0.0, 1.0)))
        plans = at(new_fps, list(pixels))
    return plans, {"fps": new_fps if has_video and new_fps != fps else None,
                   "max_pixels": pixels or (None,) * len(infos)}


def _frames_then_tiles(family: Family, infos: list[Info], options: MediaOptions, plans: list[MediaPlan], cap: int
                       ) -> tuple[list[MediaPlan], dict]:
    """InternVL3: first one frame count n for every video (each keeps min(n, its frames now)), the highest that fits;
    at one frame a video still over, then one ``max_tiles`` for every image, the highest that fits."""
    frames = [p.num_groups if isinstance(i, VideoInfo) else 0 for i, p in zip(infos, plans)]
    tiles = max((p.num_groups for i, p in zip(infos, plans) if isinstance(i, ImageInfo)), default=1)
    tiles = min(tiles, options.max_tiles or tiles)  # the request's max_tiles stays an upper bound

    def at(n: int, m: int) -> list[MediaPlan]:
        return _plans(family, infos, [replace(options, num_frames=min(n, f) or None, max_tiles=m) for f in frames])

    new_frames = _highest_int(lambda n: _total(at(n, tiles)) <= cap, max(frames))
    new_tiles = _highest_int(lambda m: _total(at(new_frames, m)) <= cap, tiles)
    plans = at(new_frames, new_tiles)
    if _total(plans) > cap:
        raise _too_many(infos, _total(plans), cap, "num_frames and max_tiles")
    return plans, {"num_frames": new_frames if new_frames < max(frames) else None,
                   "max_tiles": new_tiles if new_tiles < tiles else None}


_FITS: dict[str, Callable] = {"qwen2_5_vl": _fps_then_pixels, "internvl3": _frames_then_tiles}


def _highest_int(fits: Callable[[int], bool], high: int) -> int:
    """The highest n in [1, high] with ``fits(n)`` (``fits`` monotone), or 1 when none fits."""
    low = 1
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def _highest(fits, low: float, high: float) -> float:
    """The highest x in [low, high] with ``fits(x)`` (``fits`` monotone: true at low), to within 2**-24 of the
    range."""
    if fits(high):
        return high
    for _ in range(_STEPS):
        middle = (low + high) / 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low
