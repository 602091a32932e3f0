"""Request bodies of the OpenAI-compatible API (pydantic), as OpenAI's API reference and vLLM's server name them
(the response bodies: ``backends.openai.response_schemas``).

Fields a client may send that this server does not know are ignored, and named in the API's log
(``backends.openai.ignored_fields``, as vLLM does); fields it knows but cannot
honour (``best_of``, vLLM's ``use_beam_search``, ...: ``backends.openai.unsupported``) are refused by
:meth:`GenerationRequest.refusal` when set to anything but their defaults.
"""
from __future__ import annotations

import functools
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BeforeValidator, Discriminator, Field, Tag

from backends.ipc.protocol import MAX_LOGPROBS
from backends.openai.bodies import Body, Flag
from backends.openai.response_format import as_structured_outputs, json_schema_of
from backends.openai.sampling_fields import MediaIoKwargs, SamplingRequest
from backends.openai.tools import (AssistantToolCall, Tool, ToolChoice, held_by, history_fields, reply_schema,
                                   template_tools, tool_choice_of, tool_refusal)
from backends.openai.unsupported import Unsupported, unsupported_refusal
from orchestrator.choice_reservations import MAX_CHOICES  # OpenAI's API's limit on n, and on prompts times n
from orchestrator.sampling_params import MAX_TOKENS_LIMIT, SEED_LIMIT
from orchestrator.shown import shown

MAX_PROMPTS = 128  # a completion's prompts per request
TOKEN_ID_LIMIT = 2**63  # a token-id prompt's ids travel as INT64 (the orchestrator then checks the vocabulary)


# ---- requests ---------------------------------------------------------------------------------------------------
class MediaUrl(Body):
    """``url``: a ``data:`` URL (base64), a ``file://`` URL or path under the server's allowed media folders, or an
    http(s) URL where the operator allows them. ``detail`` is accepted and ignored (the size follows max_pixels)."""

    url: str
    detail: str | None = None


# the URL alone, a plain string, is taken as {"url": <string>} (vLLM's simple image and video parts)
Media = Annotated[MediaUrl, BeforeValidator(lambda value: {"url": value} if isinstance(value, str) else value)]


class TextPart(Body):
    """A text part; ``input_text`` and ``output_text`` (the Responses API's names) are read as ``text``, as vLLM
    reads them."""

    type: Literal["text", "input_text", "output_text"]
    text: str


class RefusalPart(Body):
    """An assistant's refusal, as OpenAI's SDK sends one back in a conversation: its text, as vLLM reads it."""

    type: Literal["refusal"]
    refusal: str

    @property
    def text(self) -> str:
        return self.refusal


TEXT_PARTS = (TextPart, RefusalPart)  # the parts whose ``text`` goes to the chat template as text
_TEXT_TYPES = ("input_text", "output_text")  # read as "text" parts (TextPart)


class ImageUrlPart(Body):
    type: Literal["image_url"] = "image_url"
    image_url: Media


class VideoUrlPart(Body):
    type: Literal["video_url"] = "video_url"
    video_url: Media


def _part_type(part: object) -> object:
    """A content part's ``type``; without one, ``image_url`` or ``video_url`` where the part holds that key (vLLM's
    simple parts, ``{"image_url": "https://..."}``), else None (refused: no type)."""
    if not isinstance(part, dict):
        kind = getattr(part, "type", None)
    else:
        kind = part.get("type", next((key for key in ("image_url", "video_url") if key in part), None))
    return "text" if kind in _TEXT_TYPES else kind


def _null_type_left_out(part: object) -> object:
    """A part whose ``type`` is null as one without it (vLLM reads a null type as none)."""
    if isinstance(part, dict) and "type" in part and part["type"] is None:
        return {key: value for key, value in part.items() if key != "type"}
    return part


ContentPart = Annotated[Union[Annotated[TextPart, Tag("text")], Annotated[RefusalPart, Tag("refusal")],
                              Annotated[ImageUrlPart, Tag("image_url")], Annotated[VideoUrlPart, Tag("video_url")]],
                        Discriminator(_part_type, custom_error_type="part_type", custom_error_message=(
                            "Input should be a part of type 'text', 'image_url', 'video_url' or 'refusal'")),
                        BeforeValidator(_null_type_left_out)]


class ChatMessage(Body):
    """``developer`` is OpenAI's newer name for ``system`` and is sent as one; ``content`` may be null or left out
    (OpenAI's assistant messages), a message without parts, as vLLM takes it; ``tool``: a tool's answer. A
    message's ``name``, an assistant's ``reasoning`` (vLLM's; ``reasoning_content`` its older name) and
    ``tool_calls`` and a tool's ``tool_call_id`` go to the chat template as vLLM hands them (:meth:`template_fields`;
    the served templates do not write them, as on vLLM)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None

    def template_fields(self, role: str) -> dict:
        """The message's fields for the orchestrator besides role and content (``role`` as sent to it), which its
        ``template_data.message_fields`` hands to the template."""
        fields = {"name": self.name} if self.name is not None else {}
        if role == "assistant" and (reasoning := self.reasoning or self.reasoning_content) is not None:
            fields["reasoning"] = reasoning
        return {**fields, **history_fields(role, self.tool_calls, self.tool_call_id)}


class StreamOptions(Body):
    """OpenAI's ``include_usage`` (a last chunk with the usage) and vLLM's ``continuous_usage_stats`` (with it, every
    chunk carries its choice's usage so far); others (OpenAI's ``include_obfuscation``) are ignored."""

    include_usage: Flag = False
    continuous_usage_stats: Flag = False


class GenerationRequest(SamplingRequest):
    """A chat's or a completion's body: :class:`SamplingRequest`'s fields and the two routes' own."""

    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    # vLLM's extra parameters
    request_id: str | None = None  # the reply's id after chatcmpl-/cmpl- (an X-Request-Id header wins: request_ids)
    min_p: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    return_token_ids: Flag = False
    return_timeline: Flag = False  # ours: the reply (the last streamed chunk) carries the request's `timeline`
    n: int | None = None  # choices per prompt (backends/openai/choices.py)
    response_format: dict[str, Any] | None = None  # OpenAI's: text, json_object, json_schema
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' log probabilities, top tokens each (no stream)
    # vLLM's fields that this server cannot honour: refused unless left at their defaults (backends/openai/unsupported)
    use_beam_search: Annotated[Flag, Unsupported("beam search is not supported by this server")] = False
    watermarking: Annotated[Flag, Unsupported("watermarking is not supported by this server")] = False
    truncate_prompt_tokens: Annotated[int | None, Unsupported("prompt truncation is not supported by this server")] \
        = None
    allowed_token_ids: Annotated[list[int] | None, Unsupported(
        "not supported by this server (logit_bias can favour or ban tokens)")] = None
    bad_words: Annotated[list[str], Unsupported("not supported by this server (logit_bias can ban tokens)")] = []
    logprob_token_ids: Annotated[list[int] | None, Unsupported(
        "not supported by this server (logprobs with the top tokens are)")] = None
    return_tokens_as_token_ids: Annotated[Flag, Unsupported(
        "not supported by this server (return_token_ids gives each choice's token ids)")] = False
    repetition_detection: Annotated[dict[str, Any] | None, Unsupported("not supported by this server")] = None

    @property
    def top_logprobs_asked(self) -> int | None:
        """How many most likely tokens' log probabilities each output token comes with (0: its own alone), or None
        when the request asks for no log probabilities: the subclass's fields say."""
        return None

    @property
    def prompt_logprobs_asked(self) -> int | None:
        """How many most likely tokens each prompt token's log probabilities come with (``sampling_parameters``'
        ``prompt_logprobs``), or None when none are asked or none would show: a stream's chunks carry none (vLLM
        takes ``prompt_logprobs`` 0 in a stream and shows nothing)."""
        return None if self.stream else self.prompt_logprobs

    def refusal(self) -> tuple[str, str] | None:
        """(field, message) of the first field set to something this server cannot do, or None."""
        if (unsupported := unsupported_refusal(self)) is not None:
            return unsupported
        if (out_of_range := count_refusal("prompt_logprobs", self.prompt_logprobs)) is not None:
            return out_of_range
        if self.prompt_logprobs and self.stream:  # as vLLM: a value above 0 (-1, its "all", is out of range here)
            return "prompt_logprobs", "prompt_logprobs: not available when stream is true"
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            return "n", f"n: must be in [1, {MAX_CHOICES}], got {self.n}"
        n = self.choices_per_prompt
        if self.seed is not None and n > 1 and self.seed + n > SEED_LIMIT:  # choice i is drawn with seed + i
            return "seed", f"seed: with n {n}, must be below 2**63 - {n - 1} (choice i is drawn with seed + i)"
        if self.stream_options is not None and not self.stream:  # as OpenAI's API and vLLM answer
            return "stream_options", "stream_options: only allowed when stream is true"
        kind = (self.response_format or {}).get("type", "text")
        if kind not in ("text", "json_object", "json_schema"):
            return "response_format", f"response_format: type must be text, json_object or json_schema, got {kind!r}"
        if kind == "json_schema" and not isinstance(json_schema_of(self.response_format), dict):
            return "response_format", "response_format: json_schema.schema must be a JSON schema (an object)"
        if kind != "text" and self.structured_outputs is not None:
            return "response_format", "response_format: send it or structured_outputs, not both"
        return None

    @property
    def structured_field(self) -> str:
        """The field whose output rule goes as the orchestrator's ``structured_outputs``: ``response_format`` where
        that holds one (``tools.held_by``), else ``structured_outputs``."""
        return held_by(self.structured_outputs, self.response_format) or "structured_outputs"

    def sampling_parameters(self) -> dict[str, Any]:
        """The orchestrator's ``sampling_parameters`` (vLLM's names): the fields set, ``max_completion_tokens`` as
        ``max_tokens``; the orchestrator checks every value and refuses keys it does not know yet."""
        keys = ("max_tokens", "temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty",
                "top_k", "min_p", "min_tokens", "ignore_eos", "repetition_penalty", "stop_token_ids", "logit_bias",
                "include_stop_str_in_output", "skip_special_tokens")
        sampling = {key: getattr(self, key) for key in keys if getattr(self, key) is not None}
        if self.mm_processor_kwargs is not None:
            sampling.update(self.mm_processor_kwargs.model_dump(exclude_none=True))
        if self.top_logprobs_asked:
            sampling["logprobs"] = self.top_logprobs_asked
        if self.prompt_logprobs_asked is not None:
            sampling["prompt_logprobs"] = self.prompt_logprobs_asked
        structured = as_structured_outputs(self.response_format or {}) if self.structured_outputs is None \
            else self.structured_outputs
        if structured is not None:
            sampling["structured_outputs"] = structured
        return sampling

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM's rule: ``continuous_usage_stats`` counts only beside ``include_usage``."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    @property
    def choices_per_prompt(self) -> int:
        return self.n or 1


def count_refusal(field: str, count: int | None) -> tuple[str, str] | None:
    """(field, message) for a log probabilities' top-token count outside [0, MAX_LOGPROBS], else None: OpenAI's API
    reference's range for ``top_logprobs`` (0-20), vLLM's default ``max_logprobs``."""
    if count is not None and not 0 <= count <= MAX_LOGPROBS:
        return field, f"{field}: must be in [0, {MAX_LOGPROBS}], got {count}"
    return None


class ChatCompletionRequest(GenerationRequest):
    """vLLM's chat fields ``add_generation_prompt``, ``continue_final_message`` (a "prefilled" final message that
    the model continues) and ``chat_template_kwargs`` (the template's own variables; the two fields override the
    same keys there, as vLLM merges them) go to the orchestrator's ``chat_template_kwargs``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: Flag = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Any = None  # checked by backends.openai.tools.tool_refusal, with vLLM's rules
    parallel_tool_calls: bool | None = None  # vLLM's default: true (false: a reply's first tool call alone)
    functions: Annotated[list[Any] | None, Unsupported("not supported (OpenAI's older tools: send tools)")] = None
    function_call: Annotated[Any, Unsupported("not supported (OpenAI's older tool_choice: send tool_choice)")] = None
    echo: bool = False  # vLLM's: the reply starts with the last message's text where it has the reply's role
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's own template for the request: refused (refusal)
    media_io_kwargs: MediaIoKwargs = None

    chooses_tools: ClassVar[bool] = True  # the reply follows tool_choice (vLLM's /tokenize takes tools alone)

    @property
    def template_kwargs(self) -> dict[str, Any] | None:
        """The orchestrator's ``chat_template_kwargs`` (None: the defaults, nothing to send), with the ``tools`` the
        template gets (also with ``tool_choice`` "none": vLLM's ``exclude_tools_when_tool_choice_none`` is off by
        default; a ``tools`` key of ``chat_template_kwargs`` wins, as vLLM merges them)."""
        kwargs = {**({"tools": template_tools(self.tools)} if self.tools else {}), **(self.chat_template_kwargs or {}),
                  "add_generation_prompt": self.add_generation_prompt,
                  "continue_final_message": self.continue_final_message}
        return None if kwargs == {"add_generation_prompt": True, "continue_final_message": False} else kwargs

    @functools.cached_property
    def tool_choice_asked(self) -> ToolChoice | None:
        """What the tools ask of the reply (a named function's arguments or "required"'s calls), or None; found once."""
        return tool_choice_of(self.tools, self.tool_choice, self.parallel_tool_calls) if self.chooses_tools else None

    @property
    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def echoed(self) -> str:
        """With ``echo``, the last message's text (its text parts joined by line breaks, as vLLM's conversation
        holds them) where that message has the reply's role (the assistant's, unless ``add_generation_prompt`` is
        false: then the last message's own): vLLM's chat echo. Else empty."""
        last = self.messages[-1]
        if not self.echo or (self.add_generation_prompt and last.role != "assistant"):
            return ""
        if last.content is None or isinstance(last.content, str):
            return last.content or ""
        return "\n".join(part.text for part in last.content if isinstance(part, TEXT_PARTS))

    def refusal(self) -> tuple[str, str] | None:
        if (out_of_range := count_refusal("top_logprobs", self.top_logprobs)) is not None:
            return out_of_range
        if self.top_logprobs and not self.logprobs:  # as OpenAI's API and vLLM answer
            return "top_logprobs", "top_logprobs: only allowed when logprobs is true"
        held = held_by(self.structured_outputs, self.response_format)
        if (refused := tool_refusal(self.tools, self.tool_choice, held, self.chooses_tools)):
            return refused
        if self.chat_template is not None:  # vLLM 0.26 refuses it too, unless run with --trust-request-chat-template
            return "chat_template", "chat_template: this server applies its own template only (see --chat-template)"
        if self.max_completion_tokens is not None and not 0 < self.max_completion_tokens < MAX_TOKENS_LIMIT:
            # the orchestrator would name max_tokens, which this request did not send
            return "max_completion_tokens", (f"max_completion_tokens: must be a positive integer below 2**31, got "
                                             f"{shown(self.max_completion_tokens)}")
        return super().refusal()

    def sampling_parameters(self) -> dict[str, Any]:
        """Without ``max_tokens`` or ``max_completion_tokens``, ``max_tokens`` null: the reply may run to the end of
        the context, as vLLM's chat (at most the orchestrator's ``default_max_tokens``: ``orchestrator.reply_limit``);
        a completion request's default is 16, as vLLM's."""
        sampling = super().sampling_parameters()
        if self.max_completion_tokens is not None:
            sampling["max_tokens"] = self.max_completion_tokens
        sampling.setdefault("max_tokens", None)
        if (choice := self.tool_choice_asked) is not None:  # the reply's only schema (tool_refusal: held_by)
            sampling["structured_outputs"] = {"json": reply_schema(self.tools, choice)}
        return sampling


class CompletionRequest(GenerationRequest):
    """``prompt``: a string, token ids (a list of integers), or a list of at most ``MAX_PROMPTS`` of either (each
    completed as it is, without the chat template; choice ``k`` is prompt ``k // n``'s), as vLLM takes them.
    ``echo``: each choice's text starts with its prompt (token ids: the text they decode to); with
    ``logprobs``, its log probabilities start with the prompt tokens' (the first's null, as vLLM gives them: the
    prompt's log probabilities are asked with ``logprobs`` top tokens unless ``prompt_logprobs`` says)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = None
    prompt_embeds: Annotated[str | list[str] | None, Unsupported(
        "prompt embeddings are not supported by this server (send the prompt as text or token ids)")] = None

    @property
    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: the prompt alone (vLLM's echo without generation, run as one token)."""
        return self.echo and self.max_tokens == 0

    def sampling_parameters(self) -> dict[str, Any]:
        sampling = super().sampling_parameters()
        if self.echo_only:
            sampling["max_tokens"] = 1
        return sampling

    @property
    def prompt_logprobs_asked(self) -> int | None:
        if self.echo:  # vLLM's rule: echo's log probabilities hold the prompt's, streamed too
            return self.logprobs if self.prompt_logprobs is None else self.prompt_logprobs
        return super().prompt_logprobs_asked

    def refusal(self) -> tuple[str, str] | None:
        if (out_of_range := count_refusal("logprobs", self.logprobs)) is not None:
            return out_of_range
        if isinstance(self.prompt, list) and not 1 <= len(self.prompts) <= MAX_PROMPTS:
            return "prompt", f"prompt: a list of 1 to {MAX_PROMPTS} prompts is taken, got {len(self.prompts)}"
        for k, ids in enumerate(self.prompts):
            where = "prompt" if len(self.prompts) == 1 else f"prompt[{k}]"
            if isinstance(ids, list) and not ids:
                return "prompt", f"{where}: the token ids are empty"
            if isinstance(ids, list) and not all(0 <= i < TOKEN_ID_LIMIT for i in ids):
                bad = next(i for i in ids if not 0 <= i < TOKEN_ID_LIMIT)
                return "prompt", f"{where}: token id {shown(bad)} is not in [0, 2**63)"
        if len(self.prompts) * self.choices_per_prompt > MAX_CHOICES:
            return "n", f"n: {self.choices_per_prompt} choices of each of {len(self.prompts)} prompts make " \
                        f"{len(self.prompts) * self.choices_per_prompt}, at most {MAX_CHOICES}"
        if self.best_of not in (None, 1):
            return "best_of", f"best_of: one candidate per choice is supported, got {self.best_of}"
        if self.suffix:
            return "suffix", "suffix: not supported by this server"
        return super().refusal()

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a text or token ids; [] for an empty list (refused by :meth:`refusal`)."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)
