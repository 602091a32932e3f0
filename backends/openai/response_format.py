"""OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``) as vLLM's ``structured_outputs``, which
the orchestrator takes (``orchestrator.structured_outputs``)."""
from __future__ import annotations

from typing import Any


def as_structured_outputs(response_format: dict[str, Any]) -> dict[str, Any] | None:
    """``response_format`` as vLLM's ``structured_outputs`` (None for text), as vLLM converts it."""
    if response_format.get("type") == "json_object":
        return {"json_object": True}
    if response_format.get("type") == "json_schema":
        return {"json": json_schema_of(response_format)}
    return None


def json_schema_of(response_format: dict[str, Any]) -> object:
    """``json_schema.schema`` of a ``response_format``, or None where it has none (refused, read before that)."""
    spec = response_format.get("json_schema")
    return spec.get("schema") if isinstance(spec, dict) else None
