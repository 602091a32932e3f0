"""The request bodies' common ground (pydantic): the base classes and the null-tolerant flag every body module
(``schemas``, ``tools``, ``tokenize_schemas``) builds on."""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict


class Body(BaseModel):
    """Fields it does not declare are ignored (the request models log them: ``ignored_fields``). Strict: a value of
    the wrong JSON type is refused (400) as the orchestrator refuses it, not coerced ("yes" is no boolean, true no
    number)."""

    model_config = ConfigDict(extra="ignore", strict=True)


class StrictBody(BaseModel):
    """As :class:`Body`, with undeclared fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True)


# a flag that may be sent as null, which means its default, false (OpenAI's API takes "stream": null)
Flag = Annotated[bool, BeforeValidator(lambda value: False if value is None else value)]
