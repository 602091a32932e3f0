"""Model families (Qwen2.5-VL, InternVL3): the per-family runtime parts, one module each (``qwen2_5_vl``,
``internvl3``, behind ``base.ModelFamily``; looked up in ``registry``), and here, without torch (the orchestrator
reads it), which family a deployment serves and the family's default per-step budgets.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from backends.runtime.presets import preset_family

# config.json's model_type -> family name
FAMILY_OF_MODEL_TYPE = {"qwen2_5_vl": "qwen2_5_vl", "internvl": "internvl3"}


@dataclass(frozen=True)
class Budgets:
    """Default per-step budgets: ``encode`` vision-encoder input patches (before the 2x2 merge / pixel shuffle),
    ``prefill`` LLM tokens (docs/design.md, "Scheduling"). Raises ValueError for non-positive values."""

    encode: int
    prefill: int

    def __post_init__(self) -> None:
        if self.encode < 1 or self.prefill < 1:
            raise ValueError(f"budgets must be positive, got {self}")


# The paper's deployment notes (docs/design.md, "Scheduling"): Qwen2.5-VL prefill 2048 / encode 10240, InternVL3
# prefill 2048 / encode 5120.
DEFAULT_BUDGETS = {"qwen2_5_vl": Budgets(encode=10240, prefill=2048), "internvl3": Budgets(encode=5120, prefill=2048)}


def family_name(preset: str, model_path: str | None) -> str:
    """The family served: the checkpoint's (its config.json's ``model_type``) when ``model_path`` is given, else the
    preset's. Raises OSError for a missing or unreadable config.json, ValueError for an unknown preset or a
    ``model_type`` of no family."""
    if model_path is None:
        return preset_family(preset)
    config = Path(model_path) / "config.json"
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError) as exc:
        raise OSError(f"cannot read the model_type of {config}: {exc}") from None
    if model_type not in FAMILY_OF_MODEL_TYPE:
        raise ValueError(f"{config}: model_type {model_type!r} is not served (one of {sorted(FAMILY_OF_MODEL_TYPE)})")
    return FAMILY_OF_MODEL_TYPE[model_type]
