"""What a family's visual-token cap rule (`Family.lower_visual_tokens`) is made of: a request's media planned at other
settings, their tokens, and searches for the highest setting that fits. From metadata alone; no torch."""
from __future__ import annotations

from typing import Callable

from flashcodec.families.base import Family, MediaOptions, MediaPlan
from flashcodec.probe import ImageInfo, VideoInfo

STEPS = 24  # bisection steps: a fractional setting (fps, pixel scale) to within 2**-24 of the best that fits

Info = VideoInfo | ImageInfo


class OverCap(ValueError):
    """A request's media exceed a visual-token cap even at the family's lowest settings: `lowest` tokens at the
    lowest `knobs` (the settings' names, as words), over `cap`."""

    def __init__(self, lowest: int, cap: int, knobs: str):
        super().__init__(f"{lowest} visual tokens at the lowest {knobs}, over the cap of {cap}")
        self.lowest, self.cap, self.knobs = lowest, cap, knobs


def plan_tokens(plan: MediaPlan) -> int:
    """The LLM tokens of one plan (visual tokens after the 2x2 merge / pixel shuffle)."""
    return plan.num_groups * plan.tokens_per_group


def total_tokens(plans: list[MediaPlan]) -> int:
    """The LLM tokens of all `plans` (:func:`plan_tokens` summed)."""
    return sum(map(plan_tokens, plans))


def plan_all(family: Family, infos: list[Info], options: list[MediaOptions]) -> list[MediaPlan]:
    """Each item's plan by `family`'s rules and its own options (`MediaOptions.for_kind` keeps those about its kind).
    Raises ValueError / MediaError as the family's `plan_image` and `plan_video`."""
    return [family.plan_video(info, o.for_kind("video")) if isinstance(info, VideoInfo) else
            family.plan_image(info, o.for_kind("image")) for info, o in zip(infos, options)]


def highest_int(fits: Callable[[int], bool], high: int, low: int = 1) -> int:
    """The highest n in [low, high] with `fits(n)` (`fits` monotone), or `low` when none fits."""
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def highest(fits: Callable[[float], bool], low: float, high: float) -> float:
    """The highest x in [low, high] with `fits(x)` (`fits` monotone: true at low), to within 2**-`STEPS` of the
    range."""
    if fits(high):
        return high
    for _ in range(STEPS):
        middle = (low + high) / 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low
