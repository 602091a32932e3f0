"""A request's visual tokens within a cap (``max_visual_tokens``): its media lowered by the served family's own rule
(``Family.lower_visual_tokens``: fewer frames of every video, then smaller or fewer-tiled items), all from metadata
before any frame is decoded, instead of refusing the request.

Fewer frames before smaller frames (the design card's advice for 4K and long streams: a frame's detail matters more
to a question than the count of near-identical frames). The request's own settings stay upper bounds. Pure: no I/O,
no torch at import.
"""
from __future__ import annotations

from dataclasses import dataclass

from flashcodec.families import Family, MediaOptions, MediaPlan
from flashcodec.families.cap import Info, OverCap, plan_all, total_tokens
from flashcodec.probe import ImageInfo, VideoInfo
from orchestrator.sampling_params import InvalidInput


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


def fit_visual_tokens(family: Family, infos: list[Info], options: MediaOptions, cap: int | None
                      ) -> tuple[list[MediaPlan], CapApplied | None]:
    """Plans for ``infos`` (the request's media, in order) by ``family``'s rules with the request's ``options``,
    lowered until their visual tokens are at most ``cap`` (None: no cap), by the family's rule (module docstring).

    Returns the plans and what was changed (None when the request fits as sent). Raises InvalidInput naming
    ``max_visual_tokens`` when even the lowest settings exceed it; ValueError / MediaError as the family's plans.
    """
    plans = plan_all(family, infos, [options] * len(infos))
    before = total_tokens(plans)
    if cap is None or before <= cap:
        return plans, None
    try:
        plans, changed = family.lower_visual_tokens(infos, options, plans, cap)
    except OverCap as exc:
        videos = any(isinstance(info, VideoInfo) for info in infos)
        images = any(isinstance(info, ImageInfo) for info in infos)
        inputs, advice = {(True, True): ("image and video inputs", "fewer or shorter images and videos"),
                          (False, True): ("video inputs", "fewer or shorter videos"),
                          (True, False): ("image inputs", "fewer or smaller images")}[images, videos]
        raise InvalidInput(f"{inputs}: the request's media need at least {exc.lowest} visual tokens at the lowest "
                           f"{exc.knobs}, over max_visual_tokens {cap} (the server's limit): send {advice}") from None
    return plans, CapApplied(cap, before, total_tokens(plans), **changed)
