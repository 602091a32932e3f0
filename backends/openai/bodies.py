"""The request bodies' common ground (pydantic): the base classes and the null-tolerant flag every body module
(``schemas``, ``tools``, ``tokenize_schemas``) builds on."""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict


class Body(BaseModel):
    """Fields it does not declare are ignored (the request models log them: ``ignored_fields``). Values are converted
    as vLLM 0.26's request models convert them (pydantic's lax mode, ``OpenAIBaseModel``): a number sent as a numeric
    string ("5") or a whole float (3.0), a boolean as "true" / "false" (or "yes", 1, ...); anything else of the wrong
    JSON type is refused (400) naming the field."""

    model_config = ConfigDict(extra="ignore")


class StrictBody(BaseModel):
    """As :class:`Body`, with undeclared fields refused."""

    model_config = ConfigDict(extra="forbid")


# a flag that may be sent as null, which means its default, false (OpenAI's API takes "stream": null)
Flag = Annotated[bool, BeforeValidator(lambda value: False if value is None else value)]
