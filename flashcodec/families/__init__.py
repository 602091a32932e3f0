"""Model families' torch-free side, one module per family behind `base.Family`: media rules, the visual-token cap
rule, the checkpoints' `model_type` and the default budgets. `FAMILIES` is the one list of them; `family(name)`,
`family_of(plan)` and `family_for_model_type(model_type)` are how the stages reach them."""
from __future__ import annotations

from flashcodec.families.base import Budgets, Family, MediaOptions, MediaPlan, PromptExpansion
from flashcodec.families.internvl3 import InternVL3
from flashcodec.families.qwen2_5_vl import Qwen25VL

FAMILIES: dict[str, Family] = {f.name: f for f in (Qwen25VL(), InternVL3())}

__all__ = ["FAMILIES", "Budgets", "Family", "MediaOptions", "MediaPlan", "PromptExpansion", "family", "family_of",
           "family_for_model_type"]


def family(name: str) -> Family:
    """The family called `name` ("qwen2_5_vl", "internvl3"). Raises ValueError naming the known ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}: one of {', '.join(FAMILIES)}") from None


def family_of(plan: MediaPlan) -> Family:
    """The family whose rules made `plan` (its `family` class attribute)."""
    return FAMILIES[plan.family]


def family_for_model_type(model_type: str) -> Family:
    """The family whose checkpoints' config.json has `model_type` ("qwen2_5_vl", "internvl"). Raises ValueError
    naming the served ones for another."""
    for f in FAMILIES.values():
        if f.model_type == model_type:
            return f
    raise ValueError(f"model_type {model_type!r} is not served "
                     f"(one of {sorted(f.model_type for f in FAMILIES.values())})")
