"""The Responses API's request body, as vLLM 0.26 takes it (``vllm/entrypoints/openai/responses/protocol.py``,
``ResponsesRequest``), and the chat completion request it runs as (:meth:`ResponsesRequest.chat_request`): vLLM
renders a response's ``instructions`` and ``input`` through its chat path too (``responses/utils.py``,
``construct_input_messages``: the instructions as a system message first, then the input's messages).

Served: ``input`` (a string, a user message, or a list of message items: ``role`` user, system, developer or
assistant; ``content`` a string or parts, ``input_text`` / ``output_text`` / ``refusal`` and ``input_image``),
``instructions``, ``max_output_tokens``, ``text.format`` (as a chat's ``response_format``), ``include`` of
``message.output_text.logprobs`` (with ``top_logprobs``, 0-20 as OpenAI's API reference says, checked also where not
asked), ``reasoning.effort`` (to the chat template, as vLLM hands it), a last item whose ``status`` is
``in_progress`` or ``incomplete`` (continued, vLLM's ``should_continue_final_message``), and
:class:`SamplingRequest`'s fields; null as a field left out. ``store`` is taken and nothing is stored: vLLM 0.26
ignores it unless started with ``VLLM_ENABLE_RESPONSES_API_STORE=1`` (``serving.py``), so a ``previous_response_id``
names nothing (vLLM's 404). Refused (a 400 naming the field, :meth:`ResponsesRequest.refusal`): what vLLM refuses
without its store (``background``), or at all (``prompt``), and what this server cannot serve (``tools``, auto
``truncation``, items other than messages, files, a stored ``conversation``, which vLLM 0.26 does not know). A chat's
own parts (``text``, ``image_url``, ``video_url``) are refused, as vLLM's validation of OpenAI's input types refuses
them.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import BeforeValidator, Discriminator, Field, Tag
from pydantic_core import PydanticCustomError

from backends.openai.bodies import Body, Flag
from backends.openai.errors import PROMPT_TOO_LONG, ApiError, unplaced
from backends.openai.sampling_fields import MediaIoKwargs, SamplingRequest
from backends.openai.schemas import (ChatCompletionRequest, ChatMessage, ImageUrlPart, MediaUrl, TextPart,
                                     count_refusal)
from backends.openai.unsupported import Unsupported, unsupported_refusal
from orchestrator.shown import shown

LOGPROBS = "message.output_text.logprobs"  # the one `include` that changes the reply here
CONTINUED = ("in_progress", "incomplete")  # a last item's status that asks for it to be continued (vLLM's rule)
BOTH = "instructions, input"  # the param of a prompt too long that both make


class InputText(Body):
    """A text part: ``input_text`` (OpenAI's input), ``output_text`` (an assistant turn's, as a former reply has it;
    its ``annotations`` and ``logprobs`` are ignored)."""

    type: Literal["input_text", "output_text"]
    text: str


class InputImage(Body):
    """OpenAI's ``input_image``: ``image_url`` a URL as a chat's ``image_url`` takes it (``data:``, ``file://`` or a
    path under the allowed media folders, http(s) where the operator allows them); ``detail`` is taken and ignored,
    as a chat's; ``file_id`` is refused (no files are kept here)."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class InputRefusal(Body):
    """A ``refusal`` part (OpenAI's ``ResponseOutputRefusal``, an assistant turn's as a former reply has it): its
    ``refusal`` is the message's text, as the assistant said it (vLLM 0.26 takes the part, as its output message's,
    and reads the text of an assistant message's first part alone, which a refusal part has none of)."""

    type: Literal["refusal"]
    refusal: str


# the parts' tags, which errors leave out of a field's place (errors.unplaced)
_PART_TAGS = {"input_text": unplaced("text"), "output_text": unplaced("text"), "refusal": unplaced("refusal"),
              "input_image": unplaced("image")}


def _part_tag(part: object) -> str | None:
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    return _PART_TAGS.get(kind) if isinstance(kind, str) else None


InputPart = Annotated[Union[Annotated[InputText, Tag(_PART_TAGS["input_text"])],
                            Annotated[InputRefusal, Tag(_PART_TAGS["refusal"])],
                            Annotated[InputImage, Tag(_PART_TAGS["input_image"])]],
                      Discriminator(_part_tag, custom_error_type="part_type", custom_error_message=(
                          "Input should be a part of type 'input_text', 'output_text', 'refusal' or 'input_image' "
                          "(files and audio are not served)"))]


def _message_item(item: object) -> object:
    """An input item that is a message (its ``type`` "message" or left out), else refused: the other items
    (function calls and their outputs, reasoning, references to stored items) come with tools or a store."""
    kind = item.get("type", "message") if isinstance(item, dict) else "message"
    if kind != "message":
        raise PydanticCustomError("item_type", "only message items are served (role and content), not {kind} items "
                                  "(this server's Responses API runs no tools and stores nothing)",
                                  {"kind": shown(kind)})
    return item


class InputMessage(Body):
    """A message item (OpenAI's ``EasyInputMessage`` and ``Message``; an assistant's as a former reply's output
    message). ``developer`` goes as ``system``, as a chat's."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputPart]
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    id: str | None = None


class TextFormat(Body):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its ``schema`` and ``name`` (both
    required, as by vLLM 0.26's type, OpenAI's ``ResponseFormatTextJSONSchemaConfig``; the name's pattern in OpenAI's
    API reference, ``^[a-zA-Z0-9_-]{1,64}$``, is not checked, as vLLM does not check it) and ``strict``,
    ``description`` (taken), held as a chat's ``response_format`` is (``response_format``: vLLM's
    ``extract_structured_outputs``)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Body):
    """``text``: its ``format``; ``verbosity`` is taken and echoed, and read by no served model (vLLM ignores it)."""

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(Body):
    """``reasoning``: ``effort`` goes to the chat template (vLLM's ``reasoning_effort`` and ``enable_thinking``); the
    served families' templates read neither, and no reasoning item is answered (vLLM's without a reasoning parser)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(SamplingRequest):
    """``POST /v1/responses``'s body (the module docstring says what is served and refused). ``request_id`` (vLLM's)
    is the response's ``id`` when given; ``metadata``, ``user``, ``service_tier``, ``parallel_tool_calls``,
    ``max_tool_calls`` are echoed on the response, as vLLM echoes them."""

    input: str | list[Annotated[InputMessage, BeforeValidator(_message_item)]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    text: TextConfig | None = None
    include: list[Literal["code_interpreter_call.outputs", "computer_call_output.output.image_url",
                          "file_search_call.results", "message.input_image.image_url", "message.output_text.logprobs",
                          "reasoning.encrypted_content"]] | None = None
    top_logprobs: int | None = 0
    reasoning: ReasoningConfig | None = None
    tool_choice: Any = "auto"
    parallel_tool_calls: bool | None = True
    max_tool_calls: int | None = None
    metadata: dict[str, str] | None = None  # OpenAI's limits (16 keys, 64 and 512 characters) unchecked, as by vLLM
    user: str | None = None
    store: bool | None = True  # taken; nothing is stored (vLLM 0.26's default: the module docstring)
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = "auto"
    previous_response_id: str | None = None  # nothing is stored: a 404 (the route)
    conversation: Annotated[str | dict[str, Any] | None, Unsupported(
        "not supported: this server stores no conversations (vLLM 0.26 does not know the field); send the "
        "conversation's items in input")] = None
    prompt_cache_key: str | None = None  # OpenAI's cache routing hint, ignored as by vLLM
    request_id: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: MediaIoKwargs = None
    tools: Annotated[list[Any] | None, Unsupported(
        "not supported by this server's Responses API (a tool call is told from the reply's text by a tool-call "
        "parser, which this server does not have; /v1/chat/completions serves tool_choice required or a named "
        "function)")] = []
    background: Annotated[Flag, Unsupported(
        "not supported: this server stores no responses (as vLLM 0.26, which refuses background without "
        "VLLM_ENABLE_RESPONSES_API_STORE=1)")] = False
    truncation: Annotated[Literal["auto", "disabled"] | None, Unsupported(
        "'auto' is not supported by this server (the prompt is never truncated: it must fit max_model_len)")] \
        = "disabled"
    prompt: Annotated[dict[str, Any] | None, Unsupported("prompt templates are not supported (nor by vLLM)")] = None
    enable_response_messages: Annotated[Flag, Unsupported("not supported by this server")] = False
    previous_input_messages: Annotated[list[Any] | None, Unsupported(
        "not supported by this server (vLLM reads it for gpt-oss's harmony format only)")] = None

    @property
    def logprobs_asked(self) -> bool:
        """Whether ``include`` asks for the reply's log probabilities (vLLM's ``is_include_output_logprobs``)."""
        return LOGPROBS in (self.include or ())

    @property
    def format(self) -> TextFormat | None:
        """``text.format``, or None where not sent."""
        return self.text.format if self.text is not None else None

    @property
    def continued(self) -> bool:
        """Whether the last input item is continued rather than answered (its ``status`` in_progress or incomplete:
        vLLM's ``should_continue_final_message``)."""
        return isinstance(self.input, list) and bool(self.input) and self.input[-1].status in CONTINUED

    def refusal(self) -> tuple[str, str] | None:
        """(field, message) of the first field set to something this server cannot do, or None; the chat request it
        runs as is checked next (``ChatCompletionRequest.refusal``, its names said as this request's: :meth:`named`).
        """
        if (unsupported := unsupported_refusal(self)) is not None:
            return unsupported
        if (out_of_range := count_refusal("top_logprobs", self.top_logprobs)) is not None:  # also unasked
            return out_of_range
        if (refused := self._tool_choice_refusal()) is not None:
            return refused
        if self.format is not None and self.structured_outputs is not None:  # vLLM's rule (also for text)
            return "structured_outputs", "structured_outputs: send it or text.format, not both"
        if self.format is not None and self.format.type == "json_schema":  # both required by vLLM's type
            if self.format.schema_ is None:
                return "text", "text.format.schema: Field required (type json_schema needs its schema, a JSON schema " \
                               "object)"
            if self.format.name is None:
                return "text", "text.format.name: Field required (type json_schema needs its schema's name)"
        if not self.instructions and self.input == []:
            return "input", "input: no message to answer (an empty list, and no instructions)"
        for i, item in enumerate(self.input if isinstance(self.input, list) else ()):
            for j, part in enumerate(item.content if isinstance(item.content, list) else ()):
                if isinstance(part, InputImage) and part.image_url is None:
                    what = "files are not served by this server" if part.file_id is not None else "Field required"
                    return "input", f"input[{i}].content[{j}].image_url: {what} (send the image's URL, or a data: URL)"
        return None

    def _tool_choice_refusal(self) -> tuple[str, str] | None:
        """``tool_choice`` "required" or an object (a named tool) needs tools (vLLM's ``check_tool_usage``), which
        this server's Responses API does not serve; a value that is none of OpenAI's ``ToolChoice`` forms (vLLM's
        type) is named as such."""
        choice = self.tool_choice
        if choice in ("auto", "none", None):
            return None
        if choice != "required" and not (isinstance(choice, dict) and isinstance(choice.get("type"), str)):
            return "tool_choice", ('tool_choice: must be "none", "auto", "required" or an object naming a tool '
                                   f'({{"type": "function", "name": ...}}), got {shown(choice)}')
        return "tool_choice", f"tool_choice: {shown(choice)} needs tools, which this server's Responses API does " \
                              "not serve (auto or none is taken)"

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion this request runs as: the instructions (where not empty, as vLLM adds them) as a system
        message first, then the input's messages with their parts as the chat's; :class:`SamplingRequest`'s fields
        as they are, ``max_output_tokens`` as ``max_tokens`` (null: up to the context's end, at most the server's
        ``default_max_tokens``, as vLLM's default), ``text.format`` as ``response_format``, the log probabilities
        where ``include`` asks. Call it on a request :meth:`refusal` took."""
        shared = {name: getattr(self, name) for name in SamplingRequest.model_fields}
        text_format = self.format.model_dump(by_alias=True, exclude_none=True) if self.format is not None else None
        if text_format is not None and text_format["type"] == "json_schema":  # a chat's shape: under json_schema
            text_format = {"type": "json_schema", "json_schema": {k: v for k, v in text_format.items() if k != "type"}}
        return ChatCompletionRequest(
            **shared, messages=self._messages(), max_tokens=self.max_output_tokens, response_format=text_format,
            logprobs=self.logprobs_asked, top_logprobs=self.top_logprobs if self.logprobs_asked else None,
            add_generation_prompt=not self.continued, continue_final_message=self.continued,
            chat_template_kwargs=self._template_kwargs(), media_io_kwargs=self.media_io_kwargs)

    def _messages(self) -> list[ChatMessage]:
        messages = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        if isinstance(self.input, str):
            return messages + [ChatMessage(role="user", content=self.input)]
        for item in self.input:
            content = item.content if isinstance(item.content, str) else [_chat_part(part) for part in item.content]
            messages.append(ChatMessage(role=item.role, content=content))
        return messages

    def _template_kwargs(self) -> dict[str, Any] | None:
        """``chat_template_kwargs`` with ``reasoning.effort`` as the template's ``reasoning_effort`` (winning over the
        same key there) and ``enable_thinking`` (effort not "none", where the kwargs do not set it), as vLLM's
        ``ResponsesRequest.build_chat_params`` merges them."""
        effort = self.reasoning.effort if self.reasoning is not None else None
        if effort is None:
            return self.chat_template_kwargs
        return {"enable_thinking": effort != "none", **(self.chat_template_kwargs or {}), "reasoning_effort": effort}

    def named(self, exc: ApiError) -> ApiError:
        """``exc``, raised for :meth:`chat_request`'s chat, naming what it names as this request sent it: a message
        ``messages[k]`` as ``instructions`` or ``input[i]`` (``input`` for a string input), ``max_tokens`` as
        ``max_output_tokens``, ``structured_outputs`` as ``text.format`` where that was sent (``param`` ``text``, as
        its other errors), a continued last message as ``input``, a prompt too long as what makes it
        (:meth:`_prompt_fields`)."""
        message, param = exc.message, exc.param
        if (found := _MESSAGE.match(message)) is not None:
            message = self._where(int(found.group(1)), found.group(2)) + message[found.end():]
        elif message.startswith("messages: "):
            message = "input: " + message.removeprefix("messages: ")
        if param == "max_tokens":
            message, param = re.sub(r"\bmax_tokens\b", "max_output_tokens", message), "max_output_tokens"
        elif param == "structured_outputs" and self.format is not None:
            message, param = "text.format" + message.removeprefix("structured_outputs"), "text"
        elif param == "messages" and message.startswith(PROMPT_TOO_LONG):
            if (param := self._prompt_fields(message)) == BOTH:
                message += " (the prompt is the instructions and the input: shorten either)"
        elif param == "continue_final_message":
            message = message.replace("chat_template_kwargs: continue_final_message",
                                      f"input: a last item whose status is {' or '.join(CONTINUED)} (continued)")
        param = {"messages": "input", "continue_final_message": "input"}.get(param, param)
        return ApiError(exc.status, message, param, exc.code)

    def _prompt_fields(self, message: str) -> str:
        """What makes the prompt of a "prompt too long" ``message``: ``input`` (vLLM's ``param`` for it), also where
        its images' visual tokens are what does not fit; ``instructions`` where the input is empty; else both
        (``BOTH``)."""
        if not self.instructions or "visual tokens fit" in message:
            return "input"
        return "instructions" if self.input == [] else BOTH

    def _where(self, k: int, rest: str) -> str:
        """Where chat message ``k`` (``rest``: what follows ``messages[k]``) came from in this request."""
        if self.instructions:
            if k == 0:
                return "instructions"
            k -= 1
        return "input" if isinstance(self.input, str) else f"input[{k}]{rest}"


_MESSAGE = re.compile(r"^messages\[(\d+)\]((?:\.content)?(?:\[\d+\])?(?:\.\w+)?)")


def _chat_part(part: InputText | InputRefusal | InputImage) -> TextPart | ImageUrlPart:
    """A Responses content part as the chat's (a refusal as its text)."""
    if isinstance(part, InputText):
        return TextPart(type="text", text=part.text)
    if isinstance(part, InputRefusal):
        return TextPart(type="text", text=part.refusal)
    return ImageUrlPart(image_url=MediaUrl(url=part.image_url, detail=part.detail))
