"""vLLM's request fields that this server accepts but cannot honour: each is declared on the request schema with
:class:`Unsupported` in its metadata and refused (a 400 naming it) when set to anything but its default, so that a
client never gets a result made without it unknowingly (``use_beam_search: true`` answered by sampling)."""
from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from orchestrator.shown import shown


@dataclass(frozen=True)
class Unsupported:
    """A field's metadata (``Annotated[..., Unsupported(...)]``): ``why`` it is refused, after "<field>: "; a
    ``{value}`` in it is replaced by the value sent."""

    why: str


def unsupported_refusal(body: BaseModel) -> tuple[str, str] | None:
    """(field, message) of ``body``'s first :class:`Unsupported` field set to anything but null or its default,
    else None."""
    for name, info in type(body).model_fields.items():
        marks = [mark for mark in info.metadata if isinstance(mark, Unsupported)]
        value = getattr(body, name)
        if marks and value not in (None, info.default):
            return name, f"{name}: {marks[0].why.format(value=shown(value))}"
    return None
