"""A response body's JSON written in slices: the same bytes as pydantic's ``model_dump_json``, made by many short
calls instead of one long one.

pydantic writes JSON in Rust and holds the GIL throughout: one call over the 58 MB of a 16,000-token prompt echoed
with 20 top tokens a token (two choices) holds it for about half a second, and a worker thread doing it stalls the
event loop of the API process, every stream it serves, as long (bench/results/big-reply-stall-cpu-2026-12-05/). Here
a model's fields are written one by one and a long list ``SLICE`` elements at a time, each by pydantic
(``pydantic_core.to_json``, its serializers and settings), so another thread can take the GIL between the calls.
"""
from __future__ import annotations

import json

from pydantic import BaseModel
from pydantic_core import to_json

SLICE = 1024  # list elements a call: a 16,000-token prompt's 20 top tokens are about 1.8 KB an element


def sliced_json(value: object) -> bytes:
    """``value``'s JSON as ``model_dump_json()`` writes it for a model (its fields' ``exclude_if`` followed;
    ``to_json`` for anything else), written field by field (a list of models, model by model) and ``SLICE`` list
    elements at a time."""
    if isinstance(value, BaseModel):
        fields = [(name, getattr(value, name), info.exclude_if) for name, info in type(value).model_fields.items()]
        return b"{" + b",".join(json.dumps(name).encode() + b":" + sliced_json(field)
                                for name, field, left_out in fields if not (left_out and left_out(field))) + b"}"
    if isinstance(value, list) and any(isinstance(element, BaseModel) for element in value):  # choices: one by one
        return b"[" + b",".join(sliced_json(element) for element in value) + b"]"
    if isinstance(value, list) and len(value) > SLICE:
        return b"[" + b",".join(to_json(value[k:k + SLICE])[1:-1] for k in range(0, len(value), SLICE)) + b"]"
    return to_json(value)
