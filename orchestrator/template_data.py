"""What the chat template gets besides the messages' text and media (no Triton, no torch): a request's ``tools``
(transformers' ``apply_chat_template(tools=...)``, where vLLM hands them) and a message's own fields, an assistant
message's ``tool_calls`` and a tool message's ``tool_call_id``, as vLLM's ``chat_utils`` copies them into its
conversation. A tool call's ``function.arguments``, a JSON string in OpenAI's messages, is handed over parsed (an
object), as vLLM's ``_postprocess_messages`` parses it for templates (none or empty: ``{}``).

The template writes them itself (with ``tojson`` or as they are), so they are tokenized with its text: a special
token in them is a special token, as in vLLM's prompt (message texts are tokenized on their own:
``orchestrator.prompt``). Each is checked here (JSON at most ``MAX_DEPTH`` deep, Unicode text, no NUL: the prompt's
text marks hold NUL), and ``orchestrator.prompt`` refuses the media tokens only the server places in them.
"""
from __future__ import annotations

import json

from orchestrator.sampling_params import InvalidInput, json_value, unicode_text

MAX_DEPTH = 64  # nesting of a tool's schema or a call's arguments (the template's tojson recurses through it)
MAX_TOOLS_BYTES = 960 << 10  # the tools' JSON (UTF-8), within chat_template_kwargs' 1 MiB


def template_json(where: str, value: object) -> str:
    """``value`` checked (module docstring) and written as JSON text (hashable: prompts are cached by it). Raises
    InvalidInput naming ``where``: nested more than ``MAX_DEPTH`` deep, a string holding NUL or a lone surrogate."""
    stack = [(value, 0)]
    while stack:  # not recursive: a value parsed from JSON may be nested near Python's recursion limit
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise InvalidInput(f"{where}: nested more than {MAX_DEPTH} deep")
        if isinstance(node, dict):
            stack.extend((item, depth + 1) for pair in node.items() for item in pair)
        elif isinstance(node, list):
            stack.extend((item, depth + 1) for item in node)
        elif isinstance(node, str) and "\x00" in node:
            raise InvalidInput(f"{where}: holds a NUL character")
    return unicode_text(where, json.dumps(value, ensure_ascii=False))


def parse_tools(value: object) -> str | None:
    """``chat_template_kwargs``' ``tools`` (null: none), a list of tool objects (OpenAI's ``{"type": "function",
    "function": {"name", "description", "parameters"}}``, handed to the template as they are), as JSON text. Raises
    InvalidInput naming ``chat_template_kwargs: tools``: not such a list, over ``MAX_TOOLS_BYTES``, or as
    :func:`template_json` says."""
    if value is None:
        return None
    where = "chat_template_kwargs: tools"
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        raise InvalidInput(f"{where} must be a list of tool objects ({{\"type\": \"function\", \"function\": "
                           f"{{\"name\": ...}}}}), got {json.dumps(value)[:80]}")
    text = template_json(where, value)
    if (size := len(text.encode())) > MAX_TOOLS_BYTES:
        raise InvalidInput(f"{where}: {size} bytes of JSON, over the limit of {MAX_TOOLS_BYTES}")
    return text


def message_fields(where: str, role: str, message: dict) -> tuple[tuple[str, str], ...]:
    """Message ``message``'s fields for the template besides role and content, as (name, JSON text) pairs, as
    vLLM's ``_parse_chat_message_content`` hands them: a ``name`` (a string) on any role; an assistant message's
    ``reasoning`` (or ``reasoning_content``, its older name: the template gets both) and non-empty ``tool_calls``;
    a tool message's ``tool_call_id`` (a string); vLLM ignores the rest. Raises InvalidInput naming
    ``where.name`` or ``where.tool_call_id`` that is not a string (null: none; OpenAI's and vLLM's request models
    take strings alone), or ``where.tool_calls[j]...``: not a list of objects, a call not of type "function" or
    without a function name, arguments neither a JSON string nor an object, arguments not JSON."""
    fields = {}
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None and not isinstance(message[key], str):
            raise InvalidInput(f"{where}.{key}: must be a string, got {type(message[key]).__name__}")
    if message.get("name") is not None:  # a string: checked above
        fields["name"] = message["name"]
    if role == "tool" and message.get("tool_call_id") is not None:
        fields["tool_call_id"] = message["tool_call_id"]
    if role == "assistant":
        reasoning = message.get("reasoning") or message.get("reasoning_content")
        if isinstance(reasoning, str):
            fields["reasoning"] = fields["reasoning_content"] = reasoning
        calls = message.get("tool_calls")
        if calls is not None and calls != []:  # vLLM drops an empty list: a plain assistant turn
            if not isinstance(calls, list):
                raise InvalidInput(f"{where}.tool_calls: must be a list of tool calls, got {type(calls).__name__}")
            fields["tool_calls"] = [_tool_call(f"{where}.tool_calls[{j}]", call) for j, call in enumerate(calls)]
    return tuple((name, template_json(f"{where}.{name}", value)) for name, value in fields.items())


def _tool_call(where: str, call: object) -> dict:
    """One tool call of an assistant message, its ``function.arguments`` parsed (vLLM's rule: none, null or empty
    is ``{}``; an object is kept)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or call.get("type", "function") != "function":
        raise InvalidInput(f"{where}: must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                           "\"arguments\": ...}}} (function tool calls are the ones served)")
    if not isinstance(function.get("name"), str):
        raise InvalidInput(f"{where}.function.name: must be a string")
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        arguments = json_value(f"{where}.function.arguments", arguments)
        arguments = {} if arguments is None else arguments
    elif not isinstance(arguments, (dict, list)):
        raise InvalidInput(f"{where}.function.arguments: must be a JSON string or an object, got "
                           f"{json.dumps(arguments)}")
    return {**call, "function": {**function, "arguments": arguments}}
