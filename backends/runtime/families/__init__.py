"""Model families (Qwen2.5-VL, InternVL3): the per-family runtime parts, one module each (``qwen2_5_vl``,
``internvl3``, behind ``base.ModelFamily``; looked up in ``registry``), and here, without torch (the orchestrator
reads it), the model a deployment serves: its checkpoint's config.json, read once, and its family.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.runtime.presets import preset_family
from flashcodec.families import Family, family, family_for_model_type


@dataclass(frozen=True)
class ServedModel:
    """The model a deployment serves: ``preset`` (the architecture when there is no checkpoint), ``model_path`` (a
    local checkpoint, or None), ``config`` (the checkpoint's config.json as read; None without one) and ``family``
    (the family's torch-free side, ``flashcodec.families``: its media rules, cap rule and default budgets)."""

    preset: str
    model_path: str | None
    config: dict[str, Any] | None
    family: Family

    @classmethod
    def read(cls, preset: str, model_path: str | None) -> "ServedModel":
        """The served model: the checkpoint's (its config.json, read here once; its ``model_type`` picks the family)
        when ``model_path`` is given, else ``preset``'s. Raises OSError when ``model_path`` is not a directory, its
        config.json is missing or unreadable, or its generation_config.json holds JSON that is not an object;
        ValueError for an unknown preset or a ``model_type`` of no family."""
        if model_path is None:
            return cls(preset, None, None, family(preset_family(preset)))
        if not Path(model_path).is_dir():
            raise OSError(f"model_path {model_path!r} is not a directory (a local checkpoint)")
        path = Path(model_path) / "config.json"
        try:
            config = json.loads(path.read_text())
            model_type = config.get("model_type")
        except (OSError, ValueError) as exc:
            raise OSError(f"cannot read the model_type of {path}: {exc}") from None
        try:
            served = family_for_model_type(model_type)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        _check_generation_config(Path(model_path) / "generation_config.json")
        return cls(preset, model_path, config, served)


def _check_generation_config(path: Path) -> None:
    """A checkpoint's generation_config.json, where it has one, must hold a JSON object: transformers reads it with
    the weights and fails on another value with a TypeError that names no file (a file that is no JSON it skips).
    Raises OSError naming the file."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(value, dict):
        raise OSError(f"{path}: must hold a JSON object, got {type(value).__name__}: fix or remove it")
