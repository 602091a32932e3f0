"""Tool calling through the OpenAI API and a real tritonserver, driven with the ``openai`` SDK as a user drives it: a
named function's call and "required"'s calls come as ``tool_calls`` whose arguments are JSON that fits the tools'
schemas (the grammar holds the random-weights model's reply to them), streamed deltas reassemble to the whole
reply's calls, a reply cut by ``max_tokens`` is answered, and what vLLM 0.26 refuses is a 400 naming the field."""
from __future__ import annotations

import json
import urllib.request

import openai
import pytest

from tests.e2e.test_openai_api import MODEL, api, sdk  # noqa: F401 - the module's API process and SDK

pytestmark = pytest.mark.e2e
USER = [{"role": "user", "content": "What is the weather in Paris, and should I take an umbrella?"}]
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "Today's weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "rain": {"type": "boolean"}},
                   "required": ["city", "rain"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "time", "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
                                   "additionalProperties": False}}}
NAMED = {"type": "function", "function": {"name": "weather"}}
ASK = {"model": MODEL, "messages": USER, "tools": [WEATHER, TIME], "max_tokens": 200, "temperature": 0}


def _fits(name: str, arguments: str) -> None:
    """``arguments`` is JSON that fits function ``name``'s parameters."""
    value = json.loads(arguments)
    if name == "weather":
        assert set(value) == {"city", "rain"} and value["city"] in ("Paris", "Rome") and isinstance(value["rain"], bool)
    else:
        assert name == "time" and set(value) == {"utc"} and isinstance(value["utc"], bool)


def _reassembled(chunks) -> tuple[list[dict], list[str | None]]:
    """The calls a stream's deltas make (by index; a call's first delta has its id, type and name), and every
    chunk's finish_reason."""
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in chunks:
        (choice,) = chunk.choices
        reasons.append(choice.finish_reason)
        assert not choice.delta.content
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:
                assert delta.type == "function" and delta.id.startswith("chatcmpl-tool-")
                calls[delta.index] = {"name": delta.function.name, "arguments": ""}
            calls[delta.index]["arguments"] += delta.function.arguments or ""
    return [calls[k] for k in sorted(calls)], reasons


def test_a_named_function_is_called_with_arguments_that_fit_its_parameters(sdk):
    reply = sdk.chat.completions.create(**ASK, tool_choice=NAMED)
    (choice,) = reply.choices
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "weather" and call.id.startswith("chatcmpl-tool-")
    _fits("weather", call.function.arguments)
    assert choice.message.content == "" and choice.finish_reason == "stop"  # vLLM's for a named call
    streamed, reasons = _reassembled(sdk.chat.completions.create(**ASK, tool_choice=NAMED, stream=True))
    assert streamed == [{"name": "weather", "arguments": call.function.arguments}]  # the same greedy tokens
    assert reasons[-1] == "stop" and not any(reasons[:-1])


def test_required_calls_known_tools_and_the_stream_reassembles_to_the_same_calls(sdk):
    reply = sdk.chat.completions.create(**ASK, tool_choice="required")
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""
    calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls]
    assert calls
    for name, arguments in calls:
        _fits(name, arguments)
    streamed, reasons = _reassembled(sdk.chat.completions.create(**ASK, tool_choice="required", stream=True))
    assert [(call["name"], json.loads(call["arguments"])) for call in streamed] == \
        [(name, json.loads(arguments)) for name, arguments in calls]  # the whole reply's are written again
    assert reasons[-1] == "tool_calls"


def test_each_of_several_choices_has_its_own_calls(sdk):
    reply = sdk.chat.completions.create(**{**ASK, "temperature": 1.0, "max_tokens": 400}, tool_choice="required", n=3,
                                        seed=7)
    assert sorted(choice.index for choice in reply.choices) == [0, 1, 2]
    ids = set()
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            _fits(call.function.name, call.function.arguments)
            ids.add(call.id)
    assert len(ids) == sum(len(choice.message.tool_calls) for choice in reply.choices)


def test_a_reply_cut_by_max_tokens_is_answered_as_vllm_answers_it(sdk):
    """A named call keeps its text as its arguments (not JSON yet); "required"'s cut reply parses to no call."""
    named = sdk.chat.completions.create(**{**ASK, "max_tokens": 3}, tool_choice=NAMED).choices[0]
    assert named.finish_reason == "length" and named.message.tool_calls[0].function.arguments.startswith("{")
    required = sdk.chat.completions.create(**{**ASK, "max_tokens": 3}, tool_choice="required").choices[0]
    assert (required.finish_reason, required.message.content, required.message.tool_calls) == ("length", "", None)
    streamed, reasons = _reassembled(sdk.chat.completions.create(**{**ASK, "max_tokens": 3}, tool_choice="required",
                                                                 stream=True))
    assert streamed == [] and reasons[-1] == "length"  # no call begun: the reply's reason


def test_required_follows_a_tools_references_to_its_own_root(sdk):
    """A recursive tool (``$ref`` ``#``, as a tree's children) and one into its properties: each call's arguments
    are JSON that fits the tool's own schema, not the array of calls'."""
    node = {"type": "function", "function": {"name": "node", "parameters": {
        "type": "object", "properties": {"leaf": {"type": "boolean"}, "same": {"$ref": "#/properties/leaf"},
                                         "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1}},
        "required": ["leaf", "same"], "additionalProperties": False}}}
    reply = sdk.chat.completions.create(**{**ASK, "tools": [node], "max_tokens": 400}, tool_choice="required")

    def fits(value: object) -> None:
        assert isinstance(value, dict) and set(value) <= {"leaf", "same", "kids"}, value
        assert isinstance(value["leaf"], bool) and isinstance(value["same"], bool), value
        for kid in value.get("kids", []):
            fits(kid)

    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls", choice  # the reply closed its JSON
    for call in choice.message.tool_calls:
        assert call.function.name == "node"
        fits(json.loads(call.function.arguments))


def test_tool_choice_none_renders_the_tools_and_answers_in_text(sdk, api):
    """Qwen2.5-VL's template writes no tools (as on vLLM): the prompt is the one without them."""
    plain = {"model": MODEL, "messages": USER, "max_tokens": 2, "temperature": 0, "extra_body": {"ignore_eos": True}}
    without = sdk.chat.completions.create(**plain)
    reply = sdk.chat.completions.create(**plain, tools=[WEATHER], tool_choice="none")
    # greedy on the same prompt: the same text (it may be empty: the random model's tokens can all be special ones)
    assert reply.choices[0].message.tool_calls is None and reply.usage.completion_tokens == 2
    assert reply.choices[0].message.content == without.choices[0].message.content
    assert reply.usage.prompt_tokens == without.usage.prompt_tokens
    body = json.dumps({"model": MODEL, "messages": USER, "tools": [WEATHER]}).encode()
    tokenize = urllib.request.Request(f"{api.url}/tokenize", body, {"Content-Type": "application/json"})
    assert json.loads(urllib.request.urlopen(tokenize, timeout=60).read())["count"] == reply.usage.prompt_tokens


@pytest.mark.parametrize("fields, param, words", [
    (dict(tools=[WEATHER]), "tool_choice", 'tool_choice: "auto" (the default with tools) needs a tool-call parser'),
    (dict(tools=[WEATHER], tool_choice="auto"), "tool_choice", "--enable-auto-tool-choice and --tool-call-parser"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "news"}}), "tool_choice",
     "tool_choice: function 'news' is not one of the tools ('weather')"),
    (dict(tool_choice="required"), "tool_choice", 'tool_choice: "required" needs tools'),
    (dict(tools=[]), "tools", "tools: must not be an empty list"),
    (dict(tools=[WEATHER, {"type": "function", "function": {"description": "nameless"}}], tool_choice="required"),
     "tools", "tools[1].function.name: Field required"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}],
          tool_choice={"type": "function", "function": {"name": "f"}}), "tools",
     'tools[0].function.parameters: Unsupported type "x"'),  # xgrammar's refusal, named at the tool
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "response_format",
     "response_format: tool_choice \"required\" holds the reply to the tools' schema"),
    (dict(tools=[WEATHER], tool_choice=NAMED, extra_body={"min_tokens": 5}), "min_tokens",
     "with tool_choice function 'weather'"),
])
def test_what_is_refused_is_a_400_naming_the_field(sdk, fields, param, words):
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, **fields)
    error = refused.value.body
    assert error["param"] == param and words in error["message"], error
