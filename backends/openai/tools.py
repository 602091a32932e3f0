"""A chat's ``tools`` and ``tool_choice`` (the request side of tool calling; the reply side: ``tool_calls``): which
are taken, the JSON schema the reply is held to, and what the chat template gets, as vLLM 0.26 does them.

vLLM without a tool-call parser (its default, no ``--tool-call-parser``) parses no tool call from free text, so
``tool_choice`` "auto" with tools (and tools without a ``tool_choice``, which vLLM reads as "auto") is refused, as
vLLM's ``OnlineRenderer.render_chat`` refuses it. A named function and "required" are served as vLLM serves them once
a parser is set (their handling there is the parser's base class's, the same for every parser): the reply is held to
a JSON schema (``ToolParser.adjust_request``, ``tool_parsers/utils.get_json_schema_from_tools``: the function's
``parameters``, or an array of ``{"name", "parameters"}`` calls) by the structured outputs the orchestrator holds
(``orchestrator.structured_outputs``), and answered as tool calls (``backends.openai.tool_calls``). vLLM 0.26 without
a parser refuses them too ("requires --tool-call-parser"): this server has no parser to choose, and serves them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from backends.openai.bodies import Body
from orchestrator.shown import shown
from orchestrator.structured_outputs import DATA
from orchestrator.template_data import MAX_TOOLS_BYTES

EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # vLLM's schema for a function without parameters
_NAMED_FORM = '{"type": "function", "function": {"name": ...}}'
_CHOICES = f'"none", "auto", "required" or {_NAMED_FORM}'


class Function(Body):
    """A tool's function (OpenAI's ``FunctionDefinition``): ``parameters`` a JSON schema of its arguments;
    ``strict`` is taken and does not change how the arguments are held (always to the schema)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"] = "function"  # vLLM's default
    function: Function

    def template_dict(self) -> dict:
        """The tool as vLLM hands it to the chat template (its ``model_dump()``: description and parameters null
        where not given, ``strict`` only where given)."""
        function = {"name": self.function.name, "description": self.function.description,
                    "parameters": self.function.parameters}
        if self.function.strict is not None:
            function["strict"] = self.function.strict
        return {"type": self.type, "function": function}


class CalledFunction(Body):
    name: str
    arguments: str | dict[str, Any] | None = None  # OpenAI's: a JSON string (vLLM also takes an object)


class AssistantToolCall(Body):
    """A tool call of an assistant message in the history (the orchestrator parses its arguments for the
    template: ``orchestrator.template_data``)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


@dataclass(frozen=True)
class ToolChoice:
    """What a chat's tools ask of its reply: ``name`` the function whose arguments the reply is (a named
    ``tool_choice``), or ``required``: a list of one or more calls; ``parallel``: vLLM's ``parallel_tool_calls``
    (false: a reply's first call alone)."""

    name: str | None = None
    required: bool = False
    parallel: bool = True

    @property
    def described(self) -> str:
        """How messages name this choice: '"required"' or "function 'name'"."""
        return '"required"' if self.required else f"function {self.name!r}"


def tool_refusal(tools: list[Tool] | None, choice: object, held: str | None,
                 chooses: bool = True) -> tuple[str, str] | None:
    """(field, message) for tools or a ``tool_choice`` this server does not take, else None. ``chooses``: the
    request's reply follows ``tool_choice`` (vLLM's ``/tokenize`` takes tools alone). vLLM's rules
    (``ChatCompletionRequest.check_tool_usage``, ``check_structured_outputs_count``, ``render_chat``): an empty
    ``tools``; a ``tool_choice`` that is none of "none", "auto", "required" and a named function; "required" or a
    name without tools; a name not among the tools; "auto" with tools (also tools without ``tool_choice``: needs a
    tool-call parser). "auto" without tools is taken, as before this server served tools (vLLM refuses it).
    "required" with two tools defining one ``$defs`` name differently is refused, as vLLM refuses it. Refused here
    and not by vLLM: a tool with an empty name or one another tool has (a name picks its schema), and ``held``, the
    field that would hold the reply too (``structured_outputs``, or a ``response_format`` other than text), beside a
    named function or "required" (vLLM refuses a name beside json, regex or choice, and lets the tools' schema
    replace the rest unsaid)."""
    if tools == []:
        return "tools", "tools: must not be an empty list (send at least one tool, or leave tools out)"
    if tools and (size := len(json.dumps(template_tools(tools), ensure_ascii=False).encode())) > MAX_TOOLS_BYTES:
        return "tools", f"tools: {size} bytes of JSON, over the limit of {MAX_TOOLS_BYTES} (the chat template's)"
    if tools and (refused := _names_refusal(tools)) is not None:
        return refused
    if not chooses or choice == "none" or (choice in (None, "auto") and not tools):
        return None
    if choice in (None, "auto"):
        return "tool_choice", ('tool_choice: "auto" (the default with tools) needs a tool-call parser, which vLLM '
                               "enables with --enable-auto-tool-choice and --tool-call-parser and this server does "
                               'not have: send tool_choice "required", a named function, or "none"')
    if isinstance(choice, dict):
        if (refused := _named_refusal(tools, choice)) is not None:
            return refused
    elif choice != "required":
        return "tool_choice", f"tool_choice: must be {_CHOICES}, got {shown(choice)}"
    if not tools:
        what = '"required"' if choice == "required" else "a named function"
        return "tool_choice", f"tool_choice: {what} needs tools (the functions it calls)"
    if choice == "required" and (conflict := _defs_conflict(tools)) is not None:
        return "tools", conflict
    if held is not None:
        return held, (f"{held}: tool_choice {_valid_choice(choice, None).described} holds the reply to the tools' "
                      f"schema, which {held} cannot hold too: send one or the other")
    return None


def held_by(structured_outputs: object, response_format: dict | None) -> str | None:
    """The field that holds a request's reply to a grammar or schema, or None: ``structured_outputs``, or a
    ``response_format`` other than text."""
    if structured_outputs is not None:
        return "structured_outputs"
    return "response_format" if (response_format or {}).get("type", "text") != "text" else None


def _names_refusal(tools: list[Tool]) -> tuple[str, str] | None:
    """("tools", message) for a tool whose name is empty or another tool's, else None."""
    first: dict[str, int] = {}
    for k, tool in enumerate(tools):
        if not tool.function.name:
            return "tools", f"tools[{k}].function.name: must not be empty"
        if (j := first.setdefault(tool.function.name, k)) != k:
            return "tools", (f"tools[{k}].function.name: {tool.function.name!r} is tools[{j}]'s name too (a call "
                             "names its tool)")
    return None


def _named_refusal(tools: list[Tool] | None, choice: dict) -> tuple[str, str] | None:
    """(field, message) for a named ``tool_choice`` that is not ``{"type": "function", "function": {"name": N}}``
    with N a tool's name (vLLM's ``type`` default: "function"), else None."""
    function = choice.get("function")
    if choice.get("type", "function") != "function":
        return "tool_choice", f"tool_choice.type: must be \"function\", got {shown(choice.get('type'))}"
    if not isinstance(function, dict):
        return "tool_choice", f"tool_choice.function: must be an object naming a tool ({_NAMED_FORM})"
    name = function.get("name")
    if not isinstance(name, str) or not name:
        return "tool_choice", f"tool_choice.function.name: must be a tool's name (a string), got {shown(name)}"
    if tools and name not in (tool.function.name for tool in tools):
        names = ", ".join(repr(tool.function.name) for tool in tools)
        return "tool_choice", f"tool_choice: function {name!r} is not one of the tools ({names})"
    return None


def _defs_conflict(tools: list[Tool]) -> str | None:
    """The message for two tools' ``parameters`` defining one ``$defs`` name differently (the "required" schema has
    one ``$defs`` for all: ``required_schema``), else None."""
    seen: dict[str, object] = {}
    for k, tool in enumerate(tools):
        for name, schema in _defs(tool).items():
            if seen.setdefault(name, schema) != schema:
                return (f"tools[{k}].function.parameters.$defs.{name}: another tool defines {name!r} differently (the "
                        "tool calls' schema holds one definition of each name, as vLLM's)")
    return None


def _defs(tool: Tool) -> dict:
    defs = (tool.function.parameters or {}).get("$defs")
    return defs if isinstance(defs, dict) else {}


def tool_choice_of(tools: list[Tool] | None, choice: object, parallel: bool | None) -> ToolChoice | None:
    """The request's :class:`ToolChoice`, or None where its reply is plain text (no tools, or "none") or its tools
    are refused (:func:`tool_refusal`, which the request's check answers)."""
    if tool_refusal(tools, choice, None) is not None or not (isinstance(choice, dict) or choice == "required"):
        return None
    return _valid_choice(choice, parallel)


def _valid_choice(choice: dict | str, parallel: bool | None) -> ToolChoice:
    """The :class:`ToolChoice` of a named function or "required" that :func:`tool_refusal` took."""
    if isinstance(choice, dict):
        return ToolChoice(name=choice["function"]["name"], parallel=parallel is not False)
    return ToolChoice(required=True, parallel=parallel is not False)


def reply_schema(tools: list[Tool], choice: ToolChoice) -> dict:
    """The JSON schema the reply is held to (vLLM's ``get_json_schema_from_tools``): a named function's
    ``parameters`` (none: an object without properties; vLLM would hold the reply to nothing), or for "required" an
    array of at least one call, each ``{"name": <a tool's name>, "parameters": <that tool's parameters>}``, with every
    tool's ``$defs`` moved to the array's (their ``$ref`` point at the root); a tool whose schema refers to its own
    root (``#``, ``#/properties/...``) has its parameters moved there too, as ``tool<k>_parameters``, and those
    references pointed at them (:func:`rerooted`; a pointer cannot step into the array of calls: xgrammar follows
    object keys only). vLLM moves the ``$defs`` alone, which leaves such a reference pointing at the array."""
    if choice.name is not None:
        return next(tool.function.parameters for tool in tools if tool.function.name == choice.name) or EMPTY_PARAMETERS
    defs: dict = {}
    calls = []
    taken = {name for tool in tools for name in _defs(tool)}
    for k, tool in enumerate(tools):
        own = {key: value for key, value in (tool.function.parameters or EMPTY_PARAMETERS).items()
               if key != "$defs" or not isinstance(value, dict)}
        name = next(f"tool{k}_parameters{'_' * n}" for n in range(len(taken) + 1)
                    if f"tool{k}_parameters{'_' * n}" not in taken)
        tool_defs = {key: rerooted(sub, f"#/$defs/{name}") for key, sub in _defs(tool).items()}
        params = rerooted(own, f"#/$defs/{name}")
        if params != own or tool_defs != _defs(tool):  # it refers to its own root: moved where a pointer reaches
            tool_defs[name], params = params, {"$ref": f"#/$defs/{name}"}
        defs.update({key: sub for key, sub in tool_defs.items() if key not in defs})
        calls.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                     "parameters": params or EMPTY_PARAMETERS},
                      "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    return {**schema, "$defs": defs} if defs else schema


def rerooted(node: object, base: str) -> object:
    """``node`` (part of a tool's ``parameters``) with each ``$ref`` into the parameters (``#``, ``#/properties/...``,
    ``#/definitions/...``) pointing below ``base`` instead of the root; ``#/$defs/...`` (the root's in both) and the
    values of data keywords (``enum``, ``const``, ...) as they are."""
    if isinstance(node, list):
        return [rerooted(value, base) for value in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    moved = isinstance(ref, str) and (ref == "#" or ref.startswith("#/")) and not ref.startswith("#/$defs/")
    return {key: (base + ref[1:] if key == "$ref" and moved else value if key in DATA else rerooted(value, base))
            for key, value in node.items()}


def template_tools(tools: list[Tool]) -> list[dict]:
    """The tools as the chat template gets them (:meth:`Tool.template_dict`)."""
    return [tool.template_dict() for tool in tools]


def history_fields(role: str, tool_calls: list[AssistantToolCall] | None, tool_call_id: str | None) -> dict:
    """A history message's fields for the orchestrator besides role and content: an assistant's ``tool_calls`` (as
    sent: the orchestrator parses their arguments), a tool's ``tool_call_id``; vLLM ignores them on other roles."""
    if role == "assistant" and tool_calls:
        return {"tool_calls": [call.model_dump(exclude_none=True) for call in tool_calls]}
    if role == "tool" and tool_call_id is not None:
        return {"tool_call_id": tool_call_id}
    return {}

