"""Response bodies of the OpenAI-compatible API (pydantic), as OpenAI's API reference and vLLM's server name them
(the request bodies: ``backends.openai.schemas``). OpenAI's nullable fields are written as null when unset (a chunk's
``finish_reason`` and ``logprobs``); the extras (ours, vLLM's ``token_ids``, a chunk's ``usage``, a delta's role)
only when set (:func:`_extra`)."""
from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field, SkipValidation


def _is_none(value: object) -> bool:
    return value is None


def _extra():
    """A field left out of the JSON while it is None (pydantic's ``exclude_if``, which ``sliced_json`` follows)."""
    return Field(None, exclude_if=_is_none)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # of the prompt's tokens, those found in the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    """A reply's call of a tool (OpenAI's; its id vLLM's ``chatcmpl-tool-`` and 16 hex digits)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    tool_calls: list[ToolCall] | None = _extra()  # left out where none, as vLLM leaves an empty list out


class DeltaFunctionCall(BaseModel):
    name: str | None = _extra()  # a call's first delta's
    arguments: str | None = _extra()


class DeltaToolCall(BaseModel):
    """A streamed piece of a tool call: its first carries ``id``, ``type`` and the function's name, every one a
    piece of its ``arguments``; ``index``: which of the reply's calls (vLLM's ``DeltaToolCall``)."""

    id: str | None = _extra()
    type: Literal["function"] | None = _extra()
    index: int
    function: DeltaFunctionCall


class TopLogprob(BaseModel):
    """A token's text, its log probability and its text's UTF-8 bytes (OpenAI's chat ``logprobs``)."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's (legacy) completions ``logprobs``: per token, where its text starts in the choice's text, its text
    and log probability, and those of the top tokens (the sampled one among them, as vLLM gives it); an echoed
    prompt's first token has neither (null)."""

    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


# vLLM's: per prompt token, None for the first, else {"<id>": {...}}. Not validated: the orchestrator's entries, often
# hundreds of thousands of dicts, whose validation (in Rust, holding the GIL) stalled the API process's other streams
PromptLogprobs = SkipValidation[list[dict[str, dict] | None]]


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended the output
    token_ids: list[int] | None = _extra()


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    visual_cap: dict | None = _extra()  # ours: what max_visual_tokens lowered in the request's media (requests.md)
    media: list[dict] | None = _extra()  # ours: what was done with each image and video (docs/requests.md)
    timeline: dict | None = _extra()  # ours, with return_timeline: where the request's time went (docs/requests.md)
    prompt_logprobs: PromptLogprobs | None = _extra()  # vLLM's, with prompt_logprobs
    prompt_token_ids: list[int] | None = _extra()  # vLLM's, with return_token_ids: the prompt as it ran


class Delta(BaseModel):
    role: Literal["assistant"] | None = _extra()  # a choice's first chunk's
    content: str | None = _extra()
    tool_calls: list[DeltaToolCall] | None = _extra()


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None  # null until the choice's last chunk
    stop_reason: int | str | None = None  # as ChatChoice's, on the last chunk
    token_ids: list[int] | None = _extra()


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = _extra()  # the last chunk's, with stream_options.include_usage
    visual_cap: dict | None = _extra()  # on the first chunk, as on ChatCompletion
    media: list[dict] | None = _extra()  # on the first chunk, as on ChatCompletion
    timeline: dict | None = _extra()  # on the last chunk with a choice, as on ChatCompletion
    prompt_token_ids: list[int] | None = _extra()  # on choice 0's first chunk, as on ChatCompletion


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None  # streamed: null until the choice's last chunk
    stop_reason: int | str | None = None  # as ChatChoice's
    token_ids: list[int] | None = _extra()
    prompt_logprobs: PromptLogprobs | None = _extra()  # vLLM's, with prompt_logprobs
    prompt_token_ids: list[int] | None = _extra()  # vLLM's, with return_token_ids (streamed: a choice's first chunk)


class Completion(BaseModel):
    """A whole completion, and (with ``usage`` only on the last, when asked) each streamed chunk of one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = _extra()  # a whole completion's; streamed, as on ChatCompletionChunk
    timeline: dict | None = _extra()  # as on ChatCompletion


class ModelPermission(BaseModel):
    """vLLM's ``ModelPermission``, with its defaults (OpenAI's former model permissions; nothing here enforces them).
    ``created``: Unix seconds."""

    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    """A served model, as vLLM's ``/v1/models`` lists one: ``root`` the model as the server loaded it (its path, or
    the preset's name), ``parent`` null (vLLM's is a LoRA adapter's base model), ``permission`` one
    :class:`ModelPermission` with vLLM's defaults; ``created``: Unix seconds."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "unifiedserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
