"""A chat's tools and tool_choice (backends/openai/tools.py), the request side: which are taken (vLLM 0.26's rules:
"auto" needs a tool-call parser; a named function and "required" are held to vLLM's schemas), what the orchestrator
gets (the reply's JSON schema as structured_outputs, the tools in chat_template_kwargs, the history's tool calls),
read back by the orchestrator's own validation as the server would; errors name the field (a malformed tool's,
pydantic's: test_app_errors.py)."""
from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from backends.openai.convert import chat_request
from backends.openai.errors import ApiError, from_orchestrator
from backends.openai.tokenize_schemas import TokenizeChatRequest
from backends.openai.tool_calls import schema_error
from backends.openai.tools import EMPTY_PARAMETERS, ToolChoice, reply_schema
from backends.runtime.sampling.grammar import _byte_compiler, compiled
from orchestrator.inputs import InputLimits, parse_request
from tests.unit.backends.openai.test_convert import _chat, _raw

USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "weather", "description": "Today's weather.", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "time"}}  # no parameters
NAMED = {"type": "function", "function": {"name": "weather"}}


def _refusal(**fields):
    return _chat(messages=USER, **fields).refusal()


@pytest.mark.parametrize("fields, param, words", [
    (dict(tools=[]), "tools", "tools: must not be an empty list"),
    (dict(tools=[{"function": {"name": "f", "description": "x" * (960 << 10)}}], tool_choice="none"), "tools",
     "tools: 983128 bytes of JSON, over the limit of 983040 (the chat template's)"),
    (dict(tools=[WEATHER]), "tool_choice", 'tool_choice: "auto" (the default with tools) needs a tool-call parser'),
    (dict(tools=[WEATHER], tool_choice="auto"), "tool_choice", 'tool_choice: "auto" (the default with tools)'),
    (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice",
     "tool_choice: must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": "
     "...}}, got 'sometimes'"),
    (dict(tool_choice="required"), "tool_choice", 'tool_choice: "required" needs tools'),
    (dict(tool_choice=NAMED), "tool_choice", "tool_choice: a named function needs tools"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "news"}}), "tool_choice",
     "tool_choice: function 'news' is not one of the tools ('weather')"),
    (dict(tools=[WEATHER], tool_choice={"type": "function"}), "tool_choice", "tool_choice.function: must be an object"),
    (dict(tools=[WEATHER], tool_choice={"function": {"name": ""}}), "tool_choice",
     "tool_choice.function.name: must be a tool's name (a string), got ''"),
    (dict(tools=[WEATHER], tool_choice={"type": "code", "function": {"name": "weather"}}), "tool_choice",
     'tool_choice.type: must be "function"'),
    (dict(tools=[WEATHER], tool_choice=NAMED, structured_outputs={"regex": "a+"}), "structured_outputs",
     "structured_outputs: tool_choice function 'weather' holds the reply to the tools' schema, which "
     "structured_outputs cannot hold too"),
    (dict(tools=[WEATHER], tool_choice="required", structured_outputs={"disable_any_whitespace": True}),
     "structured_outputs", 'structured_outputs: tool_choice "required" holds the reply to the tools\' schema'),
    (dict(tools=[WEATHER], tool_choice=NAMED, response_format={"type": "json_object"}), "response_format",
     "response_format: tool_choice function 'weather' holds the reply"),
    (dict(tools=[{"function": {"name": ""}}], tool_choice="none"), "tools",
     "tools[0].function.name: must not be empty"),
    (dict(tools=[WEATHER, TIME, {"function": {"name": "time", "parameters": {"type": "object"}}}], tool_choice="none"),
     "tools", "tools[2].function.name: 'time' is tools[1]'s name too"),
    (dict(tools=[{"function": {"name": "a", "parameters": {"$defs": {"X": {"type": "string"}}}}},
                 {"function": {"name": "b", "parameters": {"$defs": {"X": {"type": "integer"}}}}}],
          tool_choice="required"), "tools", "tools[1].function.parameters.$defs.X: another tool defines 'X'"),
])
def test_what_vllm_refuses_is_a_400_naming_the_field(fields, param, words):
    refusal = _refusal(**fields)
    assert refusal is not None and refusal[0] == param and refusal[1].startswith(words), refusal


@pytest.mark.parametrize("fields", [
    dict(tools=[WEATHER], tool_choice="none"), dict(tool_choice="auto"), dict(tool_choice="none"),
    dict(tools=[WEATHER, TIME], tool_choice="required"), dict(tools=[WEATHER], tool_choice=NAMED),
    dict(tools=[WEATHER], tool_choice={"function": {"name": "weather"}}),  # vLLM's type default
    dict(tools=[WEATHER], tool_choice="none", structured_outputs={"regex": "a+"}),  # nothing holds it but that
    dict(tools=[WEATHER], tool_choice="required", response_format={"type": "text"}),
])
def test_what_vllm_takes_is_taken(fields):
    assert _refusal(**fields) is None


def test_a_named_function_holds_the_reply_to_its_parameters_and_the_tools_reach_the_template():
    request = chat_request(_chat(messages=USER, tools=[WEATHER, TIME], tool_choice=NAMED))
    assert request.sampling["structured_outputs"] == {"json": WEATHER["function"]["parameters"]}
    kwargs = json.loads(request.chat_template_kwargs)
    assert kwargs["tools"] == [WEATHER, {"type": "function", "function": {"name": "time", "description": None,
                                                                           "parameters": None}}]  # vLLM's dump
    parsed = parse_request(_raw(request), InputLimits())  # the orchestrator reads both back
    assert json.loads(parsed.chat.tools) == kwargs["tools"]
    assert parsed.params.structured_outputs.kind == "json"


@pytest.mark.parametrize("parameters", [None, {}])
def test_a_named_function_without_parameters_is_held_to_an_empty_object(parameters):
    """Also ``{}`` (the empty schema, which any JSON value would meet: a bare number as arguments), as "required"
    holds it."""
    tool = {"type": "function", "function": {"name": "time", "parameters": parameters}}
    assert reply_schema([_chat(messages=USER, tools=[tool]).tools[0]], ToolChoice(name="time")) == EMPTY_PARAMETERS


def test_required_points_each_tools_references_into_its_own_parameters():
    """A tool whose ``$ref`` start at its parameters' root (``#``, ``#/properties/...``, ``#/definitions/...``) has
    its parameters moved to the root's ``$defs``, those references pointed there; ``#/$defs/...`` as it is; data as
    sent; a tool without such references stays in place."""
    tree = {"function": {"name": "tree", "parameters": {
        "type": "object", "properties": {"v": {"type": "boolean"}, "same": {"$ref": "#/properties/v"},
                                         "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
                                         "at": {"$ref": "#/definitions/P"}, "d": {"$ref": "#/$defs/D"},
                                         "tag": {"const": {"$ref": "#"}}},
        "required": ["v"], "definitions": {"P": {"type": "string", "enum": ["x"]}},
        "$defs": {"D": {"$ref": "#/properties/v"}, "tool1_parameters": {"type": "null"}}}}}
    schema = reply_schema(_chat(messages=USER, tools=[WEATHER, tree]).tools, ToolChoice(required=True))
    base = "#/$defs/tool1_parameters_"  # the name the tool's own $defs took
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER["function"]["parameters"]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"$ref": base}
    assert schema["$defs"]["tool1_parameters_"]["properties"] == {
        "v": {"type": "boolean"}, "same": {"$ref": f"{base}/properties/v"},
        "kids": {"type": "array", "items": {"$ref": base}, "maxItems": 2}, "at": {"$ref": f"{base}/definitions/P"},
        "d": {"$ref": "#/$defs/D"}, "tag": {"const": {"$ref": "#"}}}
    assert schema["$defs"]["D"] == {"$ref": f"{base}/properties/v"}
    assert schema["$defs"]["tool1_parameters"] == {"type": "null"}
    spec = parse_request(_raw(chat_request(_chat(messages=USER, tools=[WEATHER, tree], tool_choice="required"))),
                         InputLimits()).params.structured_outputs
    matcher = xgr.GrammarMatcher(compiled(_byte_compiler(), spec))  # xgrammar follows the references
    reply = '[{"name": "tree", "parameters": {"v": true, "same": false, "kids": [{"v": false}], "at": "x"}}]'
    assert all(matcher.accept_token(byte) for byte in reply.encode()) and matcher.is_completed()


def test_none_renders_the_tools_and_holds_nothing():
    request = chat_request(_chat(messages=USER, tools=[WEATHER], tool_choice="none", chat_template_kwargs={"a": 1}))
    assert "structured_outputs" not in request.sampling
    assert json.loads(request.chat_template_kwargs) == {"tools": [WEATHER], "a": 1, "add_generation_prompt": True,
                                                        "continue_final_message": False}
    assert chat_request(_chat(messages=USER, tool_choice="auto")).chat_template_kwargs is None  # as before tools


def test_the_historys_tool_calls_and_answers_go_with_their_messages():
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21"},
                {"role": "user", "content": "And Rome?", "tool_call_id": "ignored"}]
    request = chat_request(_chat(messages=messages))
    sent = json.loads(request.messages)
    assert sent[1]["tool_calls"] == messages[1]["tool_calls"] and sent[2]["tool_call_id"] == "call_1"
    assert "tool_call_id" not in sent[3]
    turns = parse_request(_raw(request), InputLimits()).turns
    assert dict(turns[1].fields) == {"tool_calls": json.dumps([{"id": "call_1", "type": "function", "function": {
        "name": "weather", "arguments": {"city": "Paris"}}}])}  # parsed for the template, as vLLM parses it


def test_tokenize_takes_tools_and_no_tool_choice_as_vllms():
    body = TokenizeChatRequest.model_validate({"messages": USER, "tools": [WEATHER]})
    assert body.refusal() is None and "structured_outputs" not in body.orchestrator_request().sampling
    assert json.loads(body.orchestrator_request().chat_template_kwargs)["tools"] == [WEATHER]


@pytest.mark.parametrize("choice, message, expected", [
    (ToolChoice(name="weather"), "structured_outputs.json: properties.city: 'not' is not held",
     "tools[0].function.parameters: properties.city: 'not' is not held"),
    (ToolChoice(required=True), "structured_outputs.json: items.anyOf[1].properties.parameters.properties.x: bad",
     "tools[1].function.parameters.properties.x: bad"),
    (ToolChoice(required=True), "structured_outputs.json: items.anyOf[0].properties.parameters: bad",
     "tools[0].function.parameters: bad"),
    (ToolChoice(required=True), 'structured_outputs.json: Unsupported type "x"',
     'tools: the tool calls\' schema (tool_choice "required"): Unsupported type "x"'),
    (ToolChoice(required=True), "structured_outputs.json is 294362 characters long, at most 65536",
     'tools: the tool calls\' schema (tool_choice "required") is 294362 characters long, at most 65536'),
    (ToolChoice(name="weather"), "structured_outputs.json holds a number beyond a double's range",
     "tools[0].function.parameters holds a number beyond a double's range"),
])
def test_the_orchestrators_schema_errors_name_the_tools_parameters(choice, message, expected):
    tools = _chat(messages=USER, tools=[WEATHER, TIME]).tools
    error = schema_error(from_orchestrator(f"sampling_parameters: {message}"), tools, choice)
    assert (error.status, error.param, error.message) == (400, "tools", expected)
    other = ApiError(400, "top_k: must be ...", param="top_k")
    assert schema_error(other, tools, choice) is other and schema_error(error, tools, None) is error


@pytest.mark.parametrize("choice, named", [(ToolChoice(name="weather"), "function 'weather'"),
                                           (ToolChoice(required=True), '"required"')])
def test_an_option_structured_outputs_excludes_names_the_tool_choice(choice, named):
    """The request sent no structured_outputs: the error names what holds its reply."""
    error = schema_error(from_orchestrator("sampling_parameters: min_tokens must be 0 with structured_outputs, got 5"),
                         _chat(messages=USER, tools=[WEATHER]).tools, choice)
    assert (error.param, error.message) == ("min_tokens", f"min_tokens must be 0 with tool_choice {named}, got 5")


def test_the_orchestrators_errors_about_the_tools_name_them():
    error = from_orchestrator("chat_template_kwargs: tools: holds <|image_pad|>, which only the server places")
    assert (error.param, error.message) == ("tools", "tools: holds <|image_pad|>, which only the server places")
    error = from_orchestrator("messages[1].tool_calls[0].function.arguments: not valid JSON (Expecting value)")
    assert error.param == "messages" and error.status == 400
