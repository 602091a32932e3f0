"""A chat's tools and tool_choice (backends/openai/tools.py), the request side: which are taken (vLLM 0.26's rules:
"auto" needs a tool-call parser; a named function and "required" are held to vLLM's schemas), what the orchestrator
gets (the reply's JSON schema as structured_outputs, the tools in chat_template_kwargs, the history's tool calls),
read back by the orchestrator's own validation as the server would; errors name the field (a malformed tool's,
pydantic's: test_app_errors.py)."""
from __future__ import annotations

import json

import pytest

from backends.openai.convert import chat_request
from backends.openai.errors import ApiError, from_orchestrator
from backends.openai.tokenize_schemas import TokenizeChatRequest
from backends.openai.tool_calls import schema_error
from backends.openai.tools import EMPTY_PARAMETERS, ToolChoice, reply_schema
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
     "structured_outputs: its json, regex or choice cannot hold a reply that tool_choice holds"),
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
    dict(tools=[WEATHER], tool_choice="required", structured_outputs={"regex": "a+"}),  # the tools' schema wins
])
def test_what_vllm_takes_is_taken(fields):
    assert _refusal(**fields) is None


def test_a_named_function_holds_the_reply_to_its_parameters_and_the_tools_reach_the_template():
    request = chat_request(_chat(messages=USER, tools=[WEATHER, TIME], tool_choice=NAMED,
                                 response_format={"type": "json_object"}))
    assert request.sampling["structured_outputs"] == {"json": WEATHER["function"]["parameters"]}  # not json_object
    kwargs = json.loads(request.chat_template_kwargs)
    assert kwargs["tools"] == [WEATHER, {"type": "function", "function": {"name": "time", "description": None,
                                                                           "parameters": None}}]  # vLLM's dump
    parsed = parse_request(_raw(request), InputLimits())  # the orchestrator reads both back
    assert json.loads(parsed.chat.tools) == kwargs["tools"]
    assert parsed.params.structured_outputs.kind == "json"


def test_a_named_function_without_parameters_is_held_to_an_empty_object():
    assert reply_schema([_chat(messages=USER, tools=[TIME]).tools[0]], ToolChoice(name="time")) == EMPTY_PARAMETERS


def test_required_holds_the_reply_to_vllms_array_of_calls():
    defs_tool = {"function": {"name": "where", "parameters": {
        "type": "object", "properties": {"at": {"$ref": "#/$defs/Place"}}, "$defs": {"Place": {"type": "string"}}}}}
    request = chat_request(_chat(messages=USER, tools=[WEATHER, TIME, defs_tool], tool_choice="required"))
    schema = request.sampling["structured_outputs"]["json"]
    assert schema == {"type": "array", "minItems": 1, "$defs": {"Place": {"type": "string"}}, "items": {
        "type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["weather"]},
                            "parameters": WEATHER["function"]["parameters"]}, "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["time"]}, "parameters": EMPTY_PARAMETERS},
             "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["where"]}, "parameters": {
                "type": "object", "properties": {"at": {"$ref": "#/$defs/Place"}}}},
             "required": ["name", "parameters"]}]}}
    assert parse_request(_raw(request), InputLimits()).params.structured_outputs.kind == "json"  # xgrammar takes it


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
])
def test_the_orchestrators_schema_errors_name_the_tools_parameters(choice, message, expected):
    tools = _chat(messages=USER, tools=[WEATHER, TIME]).tools
    error = schema_error(from_orchestrator(f"sampling_parameters: {message}"), tools, choice)
    assert (error.status, error.param, error.message) == (400, "tools", expected)
    other = ApiError(400, "top_k: must be ...", param="top_k")
    assert schema_error(other, tools, choice) is other and schema_error(error, tools, None) is error


def test_the_orchestrators_errors_about_the_tools_name_them():
    error = from_orchestrator("chat_template_kwargs: tools: holds <|image_pad|>, which only the server places")
    assert (error.param, error.message) == ("tools", "tools: holds <|image_pad|>, which only the server places")
    error = from_orchestrator("messages[1].tool_calls[0].function.arguments: not valid JSON (Expecting value)")
    assert error.param == "messages" and error.status == 400
