"""A chat reply held to a tool's schema (``backends.openai.tools``) answered as tool calls, whole and streamed, as
vLLM 0.26 answers a named ``tool_choice`` and "required" (``OpenAIServingChat.chat_completion_full_generator`` and
``chat_completion_stream_generator``, the parser's ``DelegatingParser._extract_tool_calls``,
``tool_parsers/streaming.py``).

Whole: a named function's call has the reply's text as its ``arguments`` (as generated, also when ``max_tokens`` cut
it; none for an empty reply); "required" parses the reply as a JSON array of ``{"name", "parameters"}`` objects, a
call each, its ``arguments`` the parameters written again (``json.dumps(..., ensure_ascii=False)``), none where the
reply does not parse (cut by ``max_tokens``). The message's ``content`` is then "" and its ``tool_calls`` left out
where there are none. ``finish_reason``: a named function's is the reply's; "required"'s is "tool_calls" where the
reply stopped (not where ``max_tokens`` cut it: ``length``).

Streamed: a call's first delta carries its ``id``, ``type`` and name and its arguments so far, the later ones the
next pieces of its arguments (a named function's: every chunk's text; "required"'s: the text of each call's
"parameters" value as it is written, a call announced once its name is whole and its parameters have begun);
chunks that carry nothing else are not sent. "required"'s last chunk says "tool_calls" once a call was streamed
(vLLM's streamed rule, even where ``max_tokens`` cut it), else the reply's reason. With ``parallel_tool_calls``
false, the first call alone (vLLM's ``maybe_filter_parallel_tool_calls``).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from backends.openai.errors import ApiError
from backends.openai.response_schemas import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from backends.openai.tools import Tool, ToolChoice

_REQUIRED_PLACE = re.compile(r"^: items\.anyOf\[(\d+)\]\.properties\.parameters(?=[.:\[])")


def tool_call_id() -> str:
    """vLLM's ``make_tool_call_id``: ``chatcmpl-tool-`` and 16 hex digits (``random_uuid``)."""
    return f"chatcmpl-tool-{uuid.uuid4().int & (2**64 - 1):016x}"


class ToolReplies:
    """One request's replies as tool calls (the module docstring): whole (:meth:`calls`, :meth:`finish_reason`) or
    streamed, a state per choice (:meth:`deltas`, :meth:`streamed_finish_reason`)."""

    def __init__(self, choice: ToolChoice):
        self.choice = choice
        self._streams: dict[int, _NamedStream | _CallsStream] = {}

    def calls(self, text: str) -> list[ToolCall] | None:
        """A whole reply's tool calls, or None where it has none."""
        if self.choice.name is not None:
            found = [(self.choice.name, text)] if text.strip() else []
        else:
            found = [(name, json.dumps(parameters, ensure_ascii=False)) for name, parameters in _parsed_calls(text)]
        calls = [ToolCall(id=tool_call_id(), function=FunctionCall(name=name, arguments=arguments))
                 for name, arguments in found]
        return (calls if self.choice.parallel else calls[:1]) or None

    def finish_reason(self, reason: str | None) -> str | None:
        """A whole reply's ``finish_reason``: "tool_calls" for "required" where it stopped, else ``reason``."""
        return "tool_calls" if self.choice.required and reason == "stop" else reason

    def deltas(self, index: int, text: str) -> list[DeltaToolCall] | None:
        """The tool-call deltas choice ``index``'s chunk of ``text`` (its reply's next text) carries, or None."""
        stream = self._streams.setdefault(index, _NamedStream(self.choice.name) if self.choice.name is not None
                                          else _CallsStream())
        deltas = [delta for delta in stream.feed(text) if self.choice.parallel or delta.index == 0]
        return deltas or None

    def streamed_finish_reason(self, index: int, reason: str | None) -> str | None:
        """Choice ``index``'s last chunk's ``finish_reason`` (``reason`` the reply's; None before its last)."""
        stream = self._streams.get(index)
        return "tool_calls" if reason and isinstance(stream, _CallsStream) and stream.announced else reason


def _parsed_calls(text: str) -> list[tuple[str, object]]:
    """(name, parameters) of each call of a "required" reply, as vLLM's ``TypeAdapter(list[FunctionDefinition])``
    takes them: a JSON array of objects, each with a string ``name`` and ``parameters`` an object or absent (null);
    [] where the reply is not one (the whole of it, as vLLM drops it)."""
    try:
        items = json.loads(text)
    except (ValueError, RecursionError):  # cut by max_tokens (or a stop string): not JSON; nested past the parser
        return []
    if not isinstance(items, list) or not all(
            isinstance(item, dict) and isinstance(item.get("name"), str)
            and isinstance(item.get("parameters"), (dict, type(None))) for item in items):
        return []
    return [(item["name"], item.get("parameters")) for item in items]


class _NamedStream:
    """A named function's streamed call: each chunk's text is the next piece of its arguments."""

    def __init__(self, name: str):
        self.name, self.started = name, False

    def feed(self, text: str) -> list[DeltaToolCall]:
        if self.started:
            return [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))]
        self.started = True
        return [DeltaToolCall(id=tool_call_id(), type="function", index=0,
                              function=DeltaFunctionCall(name=self.name, arguments=text))]


@dataclass
class _Call:
    name: str | None = None  # once its string is whole
    arguments: str = ""  # its "parameters" value's text so far
    began: bool = False  # its "parameters" value has begun
    sent: int = -1  # the arguments' characters streamed (-1: not announced)


class _CallsStream:
    """A "required" reply's calls as its text comes: a scanner of the JSON array ``[{"name": ..., "parameters":
    ...}, ...]`` that the reply's schema holds it to (any whitespace between tokens), which notes each call's name
    once its string is whole and the text of its "parameters" value as it is written."""

    def __init__(self):
        self.calls: list[_Call] = []
        self._mode = "array"  # between calls; in a call: "key", "colon", "value" (expected), "in_value", "after"
        self._key = ""  # the key whose value is read
        self._raw = ""  # the key's, or the value's, text so far
        self._string = self._escaped = False  # in a string (the key's or the value's), after a backslash there
        self._depth = 0  # the value's brackets open

    @property
    def announced(self) -> bool:
        return any(call.sent >= 0 for call in self.calls)

    def feed(self, text: str) -> list[DeltaToolCall]:
        """The deltas of ``text``, the reply's next text: a call's first once its name is whole and its parameters
        have begun, then each new piece of its parameters' text."""
        for char in text:
            self._step(char)
        deltas = []
        for index, call in enumerate(self.calls):
            if call.name is None or not call.began or call.sent == len(call.arguments):
                continue
            piece = call.arguments[max(call.sent, 0):]
            deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=piece)) if call.sent >= 0
                          else DeltaToolCall(id=tool_call_id(), type="function", index=index,
                                             function=DeltaFunctionCall(name=call.name, arguments=piece)))
            call.sent = len(call.arguments)
        return deltas

    def _step(self, char: str) -> None:
        if self._mode == "in_value":
            self._value_char(char)
        elif self._string:  # a key
            self._raw += char
            if self._stringed(char):
                self._key, self._mode = _text(self._raw), "colon"
        elif char.isspace():
            return
        elif self._mode == "array" and char == "{":
            self.calls.append(_Call())
            self._mode = "key"
        elif self._mode == "key" and char == '"':
            self._string, self._raw = True, char
        elif self._mode == "colon" and char == ":":
            self._mode = "value"
        elif self._mode == "value":
            self._mode, self._raw, self._depth = "in_value", "", 0
            self._value_char(char)
        elif self._mode in ("key", "after") and char in ",}":
            self._mode = "key" if char == "," else "array"

    def _stringed(self, char: str) -> bool:
        """Whether ``char``, read inside a string, ends it."""
        if self._escaped:
            self._escaped = False
        elif char == "\\":
            self._escaped = True
        elif char == '"':
            self._string = False
            return True
        return False

    def _value_char(self, char: str) -> None:
        """One character of the value of ``_key``: a string, an array or object, or a scalar (which a delimiter
        ends: the delimiter is the call's)."""
        if self._string:
            self._take(char)
            if self._stringed(char) and self._depth == 0:
                self._end_value()
            return
        if self._depth == 0 and self._raw and (char in ",}" or char.isspace()):
            self._end_value()
            self._step(char)
            return
        self._string = char == '"'
        self._depth += (char in "[{") - (char in "]}")
        self._take(char)
        if self._depth == 0 and char in "]}":
            self._end_value()

    def _take(self, char: str) -> None:
        self._raw += char
        if self._key == "parameters" and self.calls:
            self.calls[-1].arguments += char
            self.calls[-1].began = True

    def _end_value(self) -> None:
        if self._key == "name" and self.calls:
            self.calls[-1].name = _text(self._raw)
        self._mode = "after"


def _text(raw: str) -> str | None:
    """The string a JSON value's text holds, or None (not a string: the reply's schema allows none there)."""
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def schema_error(exc: ApiError, tools: list[Tool] | None, choice: ToolChoice | None) -> ApiError:
    """``exc`` naming what the request sent, where it asked for tool calls: an error about the reply's schema (the
    orchestrator names it ``structured_outputs.json``) names the tool's parameters it comes from
    (``tools[k].function.parameters...``), and one about an option ``structured_outputs`` excludes (``min_tokens``)
    names the ``tool_choice``; else ``exc``."""
    prefix, beside = "structured_outputs.json", " with structured_outputs"
    if choice is None or not tools:
        return exc
    if beside in exc.message:
        return ApiError(exc.status, exc.message.replace(beside, f" with tool_choice {choice.described}"),
                        param=exc.param)
    if exc.param != "structured_outputs" or not exc.message.startswith(prefix):
        return exc
    rest = exc.message.removeprefix(prefix)  # ": why", or " is N characters long..."
    if choice.name is not None:
        k = next(k for k, tool in enumerate(tools) if tool.function.name == choice.name)
        return ApiError(400, f"tools[{k}].function.parameters{rest}", param="tools")
    if (place := _REQUIRED_PLACE.match(rest)) is not None:
        return ApiError(400, f"tools[{place.group(1)}].function.parameters{rest[place.end():]}", param="tools")
    return ApiError(400, f"tools: the tool calls' schema (tool_choice \"required\"){rest}", param="tools")
