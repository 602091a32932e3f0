"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with their HTTP status.

Over a gRPC stream Triton passes the orchestrator's error message alone, without its status code (Triton 2.51), so
an orchestrator error is classed by its message: bad input is answered with a message that starts with the input
at fault (``orchestrator.inputs``, ``orchestrator.messages``, ``orchestrator.sampling_params``; docs/design.md,
invariant 3) and becomes 400; "the server is shutting down" and "the server is overloaded" become 503; anything
else (a stage's failure, an internal error) 500. A tritonserver that cannot be reached is 503, and so is its answer
for an orchestrator that is not loaded (or is unloading: Triton's model control).
"""
from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Sequence

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from tritonclient.utils import InferenceServerException

from backends.openai.response_schemas import ErrorInfo, ErrorResponse
from backends.openai.sampling_fields import MediaOptions
from orchestrator.engine_io import SHUTTING_DOWN
from orchestrator.service import OVERLOADED

# The orchestrator's messages that the prompt is too long (orchestrator.prompt, orchestrator.service)
PROMPT_TOO_LONG = ("prompt too long", "the prompt (")
# The orchestrator's validation messages: "<input>: ...", "<input>[i]...: ...", "image 0: ...", and the two about
# the prompt's length.
_INVALID = re.compile(r"^(?:(?:text_input|messages|prompt|prompt_token_ids|image_url|video_url|image|video|"
                      r"sampling_parameters|chat_template_kwargs)"
                      r"[\[:. ]|" + "|".join(map(re.escape, PROMPT_TOO_LONG)) + ")")
_SAMPLING = "sampling_parameters"
_REQUEST_ID = re.compile(r" \[request id: [^\]]*\]$")  # the id the orchestrator names (triton_io.naming_request)
_STRUCTURED = "structured_outputs"
_SCHEMA = re.compile(rf"^{_STRUCTURED}\.json\b")  # a response_format's json_schema.schema, as the orchestrator names it
_CHOICES = "choices: "
_SAMPLING_KEY = re.compile(rf"^{_SAMPLING}: (?:unknown key ')?(\w+)")
_CHAT_KEY = re.compile(r"^(chat_template_kwargs): (?:(add_generation_prompt|continue_final_message|tools)\b)?")
_PROMPT = re.compile(r"^(?:text_input|prompt[: ]|prompt_token_ids:|the prompt \()")  # else a message's text or media
# A media item's error: "image_url: ..." (the request's only item) or "video_url (item 2 of 3): ..." (placeholder order)
_MEDIA_ITEM = re.compile(r"^(image|video)_url(?: \(item (\d+) of \d+\))?: ")
# Triton's answer (gRPC NOT_FOUND) for a model not loaded, or unloading (model control: "Request for unknown model:
# 'orchestrator' has no available versions"): the server cannot serve the request now, 503 as for a stop
_NOT_LOADED = "Request for unknown model"


class ApiError(Exception):
    """An error answered to the client: ``status`` (HTTP), ``message``, ``param`` (the request field at fault, or
    None), ``code`` (OpenAI's code, e.g. "model_not_found", or None)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        # a lone surrogate the client sent (JSON's "\ud800", e.g. in the model's name) as its escape: UTF-8 has no
        # byte for it, and the body could not be written (a 500 and a traceback instead of this error)
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def kind(self) -> str:
        """OpenAI's error ``type``: "invalid_request_error" (a status below 500) or "server_error"."""
        return "invalid_request_error" if self.status < 500 else "server_error"

    def model(self) -> ErrorResponse:
        """The body, ``{"error": {...}}``, as its model."""
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.kind, param=self.param, code=self.code))

    def body(self) -> dict:
        """The JSON body, ``{"error": {...}}``."""
        return self.model().model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def from_orchestrator(message: str, media: Sequence = (), chat: bool = False,
                      structured_as: str = _STRUCTURED) -> ApiError:
    """The error for an orchestrator's error message (classed as the module docstring says). ``media``: the chat's
    media parts in placeholder order (``convert.MediaRef``: ``kind``, ``where``), whose item an error names as the
    chat's part (``messages[1].content[0].image_url: ...`` for ``image_url (item 2 of 3): ...``); ``chat``: the
    request is a chat, whose prompt is its ``messages`` (the ``param`` of an error about the prompt's length);
    ``structured_as``: the field the request sent its ``structured_outputs`` as: ``response_format`` is named for it
    (``structured_outputs.json`` as ``response_format.json_schema.schema``)."""
    message = _at_its_part(_REQUEST_ID.sub("", message), media)  # the API's own id: vLLM's messages do not name it
    if message.startswith(_CHOICES):  # the orchestrator's input for a prompt's n (backends/openai/choices.py)
        return ApiError(400, "n: " + message.removeprefix(_CHOICES), param="n")
    if _INVALID.match(message):
        key, option = _SAMPLING_KEY.match(message), _CHAT_KEY.match(message)
        param = key.group(1) if key else (option.group(2) or option.group(1)) if option else \
            "prompt" if _PROMPT.match(message) and not chat else "messages"
        if key and param in MediaOptions.model_fields:  # sent inside mm_processor_kwargs: the field at fault
            param = "mm_processor_kwargs"
        if param == "tools":  # the request's tools, which the API sends in chat_template_kwargs
            message = message.removeprefix("chat_template_kwargs: ")
        message = _as_sent(message) if key else message
        if param == _STRUCTURED and structured_as != _STRUCTURED:  # named as the request sent it
            schema = _SCHEMA.match(message)
            message = (f"{structured_as}.json_schema.schema{message[schema.end():]}" if schema else
                       structured_as + message.removeprefix(_STRUCTURED))
            param = structured_as
        return ApiError(400, message, param=param)
    if message.startswith(OVERLOADED):  # the KV pool's waiting queue is full: as the API's own limit, retry later
        return ApiError(503, message, code="overloaded")
    if SHUTTING_DOWN in message:
        return ApiError(503, message, code="service_unavailable")
    return ApiError(500, message)


def _as_sent(message: str) -> str:
    """A ``sampling_parameters: KEY ...`` message (the orchestrator's input, which an OpenAI client never names) as
    the request sent KEY: a top-level field's name alone, ``mm_processor_kwargs.KEY`` for a media setting."""
    rest = message.removeprefix(f"{_SAMPLING}: ")
    return f"mm_processor_kwargs.{rest}" if rest.split(" ", 1)[0] in MediaOptions.model_fields else rest


def _at_its_part(message: str, media: Sequence) -> str:
    """``message`` with a media item's name (``_MEDIA_ITEM``) replaced by its part's place in the chat, where
    ``media`` holds that item (the orchestrator numbers a request's items in placeholder order, as ``media`` is)."""
    named = _MEDIA_ITEM.match(message)
    if named is None or (named.group(2) is None and len(media) != 1):
        return message
    k = int(named.group(2) or 1)
    if not 1 <= k <= len(media) or media[k - 1].kind != named.group(1):
        return message
    return f"{media[k - 1].where}: {message[named.end():]}"


def from_transport(exc: grpc.RpcError | InferenceServerException) -> ApiError:
    """The error for a failed gRPC call to tritonserver (grpc's own error, or tritonclient's wrapping of it): 503 when
    the server cannot be reached or went away, or has no orchestrator loaded (``_NOT_LOADED``), else 500."""
    if isinstance(exc, grpc.RpcError):
        code, details = exc.code().name, exc.details() or ""
    else:
        code, details = (exc.status() or "").removeprefix("StatusCode."), exc.message() or ""
    if code in ("UNAVAILABLE", "CANCELLED"):
        return ApiError(503, f"the inference server is not reachable: {details}", code="service_unavailable")
    if code == "NOT_FOUND" and details.startswith(_NOT_LOADED):
        return ApiError(503, f"the orchestrator model is not loaded (or is unloading): {details}",
                        code="service_unavailable")
    return ApiError(500, f"the inference server failed: {code}: {details}")


def _where(loc: tuple) -> str:
    """Pydantic's error location as ``messages[0].content[1].image_url.url``: without the body's own prefix, the
    union branch tried (``str``, ``list[...]``), a tagged union's tag (the part's type, repeated as its field, or a
    tag marked by :func:`unplaced`) and a body's kind where a route takes two (``/tokenize``: ``BODY_KINDS``)."""
    where = ""
    for i, item in enumerate(loc):
        if isinstance(item, int):
            where += f"[{item}]"
        elif not (i == 0 and item == "body") and "[" not in item and item not in _BRANCHES \
                and not item.startswith(_UNPLACED) \
                and not (i == 1 and loc[0] == "body" and item in BODY_KINDS) \
                and (i + 1 == len(loc) or loc[i + 1] != item):
            where += f".{item}" if where else item
    return where


_BRANCHES = {"str", "int", "float", "bool", "list", "dict"}
_UNPLACED = "~"


def unplaced(tag: str) -> str:
    """``tag``, a tagged union's (pydantic puts the tag of the branch it tried in an error's location), marked to be
    left out of the place an error names (:func:`_where`): for a tag that is no field of the body."""
    return _UNPLACED + tag

BODY_KINDS = ("chat", "completion")  # the tags of a route's body that is one of two requests (tokenize_schemas)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """Pydantic's errors as "field.path: what is wrong", and the top-level field at fault. Of a union's branches
    only the deepest errors are kept (a list of parts with a bad part is not also "not a valid string")."""
    errors = [(_where(tuple(e.get("loc", ()))), e) for e in exc.errors()]
    inputs = {where or "body": e.get("input") for where, e in errors}
    for where, error in errors:
        if error.get("type") == "json_invalid":
            return f"the body is not valid JSON ({error.get('ctx', {}).get('error', 'invalid')})", None
    deepest = [(where, e) for where, e in errors
               if not any(other.startswith(where) and other[len(where):][:1] in ("[", ".") for other, _ in errors)]
    said: dict[str, list[str]] = {}  # where -> what is wrong there, in pydantic's order
    for where, error in deepest:
        said.setdefault(where or "body", []).append(error.get("msg", "invalid"))
    message = "; ".join(f"{where}: {_one_message(msgs, inputs.get(where))}" for where, msgs in said.items())
    field = re.split(r"[\[.]", deepest[0][0])[0] if deepest else ""
    return message, field or None


_VALID_TYPE = re.compile(r"Input should be a valid (\w+)(,.*)?$")  # a lax branch's reason after the comma


def _one_message(messages: list[str], value: object) -> str:
    """A union's type errors at one place as one: "Input should be a valid string or list (got null)", not one
    "Input should be a valid ..." a branch; other messages joined as they are."""
    kinds = [m.group(1) for m in map(_VALID_TYPE.match, messages) if m]
    if len(messages) < 2 or len(kinds) < len(messages):
        return "; ".join(dict.fromkeys(messages))
    *others, last = dict.fromkeys(kinds)
    listed = f"{', '.join(others)} or {last}" if others else last
    return f"Input should be a valid {listed} (got {_json_kind(value)})"


def _json_kind(value: object) -> str:
    """What a JSON value is, in words: ``null``, ``true``, ``1.5``, "a string", "an array", "an object"."""
    if value is None or isinstance(value, (bool, int, float)):
        return json.dumps(value)
    return {str: "a string", list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def _unparsed(exc: RequestValidationError) -> bool:
    """FastAPI handed the body over as bytes, not parsed: its Content-Type is not ``application/json`` (or
    ``application/*+json``), or it has none (FastAPI's ``strict_content_type``)."""
    return any(tuple(e.get("loc", ())) == ("body",) and isinstance(e.get("input"), (bytes, bytearray))
               for e in exc.errors())


def install_handlers(app: FastAPI) -> None:
    """Every error the app answers, its own and FastAPI's (a body that fails validation is 400, as OpenAI answers,
    not FastAPI's 422; an unknown path 404), in OpenAI's shape."""

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        if _unparsed(exc):  # else pydantic's "Input should be a valid dictionary" says nothing of the cause
            kind = request.headers.get("content-type")
            return ApiError(400, "the body must be JSON, sent with Content-Type: application/json (got "
                                 + (repr(kind) if kind else "no Content-Type") + ")").response()
        message, param = _validation_message(exc)
        return ApiError(400, message, param=param).response()

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        if isinstance(bad := exc.__cause__, UnicodeDecodeError):  # FastAPI's body parsing says only "an error"
            return ApiError(400, f"the body is not valid UTF-8 JSON: byte {bad.object[bad.start]:#04x} at offset "
                                 f"{bad.start} ({bad.reason})").response()
        if isinstance(exc.__cause__, RecursionError):  # json past Python's recursion limit: not a JSONDecodeError
            return ApiError(400, "the body's JSON holds arrays or objects nested too deep to parse (about a thousand "
                                 "levels or more)").response()
        return ApiError(exc.status_code, str(exc.detail)).response()


def unexpected(exc: BaseException) -> ApiError:
    """The 500 for what should not happen under a request: a cancellation nobody asked for (grpc-aio cancels a call
    whose request iterator fails), a response that does not parse; the request ends with it, never silently."""
    what = "its call to the orchestrator was cancelled" if isinstance(exc, asyncio.CancelledError) else \
        f"{type(exc).__name__}: {exc}"
    return ApiError(500, f"internal error: {what}")
