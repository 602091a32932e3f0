"""Model families' media rules, one module per family behind `base.Family`; `family(name)` and `family_of(plan)`
are how the stages reach them."""
from __future__ import annotations

from flashcodec.families.base import Family, MediaOptions, MediaPlan, PromptExpansion
from flashcodec.families.internvl3 import InternVL3
from flashcodec.families.qwen2_5_vl import Qwen25VL

FAMILIES: dict[str, Family] = {f.name: f for f in (Qwen25VL(), InternVL3())}

__all__ = ["FAMILIES", "Family", "MediaOptions", "MediaPlan", "PromptExpansion", "family", "family_of"]


def family(name: str) -> Family:
    """The family called `name` ("qwen2_5_vl", "internvl3"). Raises ValueError naming the known ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}: one of {', '.join(FAMILIES)}") from None


def family_of(plan: MediaPlan) -> Family:
    """The family whose rules made `plan` (its `family` class attribute)."""
    return FAMILIES[plan.family]
