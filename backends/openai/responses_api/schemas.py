"""The Responses API's reply bodies (pydantic), as OpenAI's API reference names them and the ``openai`` SDK's
``Response`` and stream event types read them: the Response object, its one output message with one
``output_text`` part, its usage, and the stream's events, each with its ``type`` (also the SSE event's name) and a
``sequence_number`` counted from 0. The log probabilities' entries are the chat's (``TokenLogprob``: token, logprob,
bytes, top_logprobs), the shape OpenAI gives an ``output_text``'s.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from backends.openai.response_schemas import TokenLogprob


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[TokenLogprob] = []  # with include message.output_text.logprobs


class OutputMessage(BaseModel):
    """The reply's message item (``msg_`` and 32 hex digits); ``status`` in_progress while streamed, then
    completed, or incomplete where the reply was cut (OpenAI's)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # of the prompt's tokens, those found in the prefix cache


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # no served model reasons apart


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"  # vLLM gives it for every reply cut by a length


class ResponseObject(BaseModel):
    """OpenAI's Response (``object`` "response"), with vLLM's echoes of the request; ``created_at``: Unix seconds;
    ``output`` empty and ``usage`` null until the reply is whole (the stream's first events)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    error: None = None  # a failed reply is an error, not a response (errors.py)
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    model: str
    output: list[OutputMessage] = []
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = "auto"
    temperature: float | None = None
    text: dict[str, Any] | None = None
    tool_choice: Literal["none"] = "none"  # vLLM's "auto" without tools: none
    tools: list[Any] = []
    top_logprobs: int | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    background: bool = False


class StreamEvent(BaseModel):
    """A streamed event: ``type`` names it (the SSE ``event:`` line too), ``sequence_number`` orders it."""

    type: str
    sequence_number: int


class ResponseEvent(StreamEvent):
    """``response.created``, ``response.in_progress``, ``response.completed``: the response as it stands."""

    response: ResponseObject


class OutputItemEvent(StreamEvent):
    """``response.output_item.added`` (the message, in progress, no parts) and ``.done`` (the message whole)."""

    output_index: int = 0
    item: OutputMessage


class PartEvent(StreamEvent):
    """An event about a part of an output item: the item's id and where the part is (one item of one part here)."""

    item_id: str
    output_index: int = 0
    content_index: int = 0


class ContentPartEvent(PartEvent):
    """``response.content_part.added`` (the part, empty) and ``.done`` (the part whole)."""

    part: OutputText


class TextDeltaEvent(PartEvent):
    """``response.output_text.delta``: the text one orchestrator response brings, with its tokens' log
    probabilities where asked."""

    delta: str
    logprobs: list[TokenLogprob] = []


class TextDoneEvent(PartEvent):
    """``response.output_text.done``: the part's whole text."""

    text: str
    logprobs: list[TokenLogprob] = []


class ErrorEvent(StreamEvent):
    """``error`` (OpenAI's ``ResponseErrorEvent``): a failure after the stream's first events, its ``code`` (or its
    kind, e.g. ``server_error``, where it has none), ``message`` and ``param``; it ends the stream."""

    code: str | None = None
    message: str
    param: str | None = None
