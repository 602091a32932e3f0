"""Replies as tool calls (backends/openai/tool_calls.py through responses.ChatShape), as vLLM 0.26 answers a named
tool_choice and "required": the whole message (content "", tool_calls, finish_reason), and the streamed deltas (a
call's first with id, type and name, then its arguments' pieces), which reassemble to the whole reply's calls
wherever the text is cut into chunks."""
from __future__ import annotations

import json
import random
import re

import pytest

from backends.openai.responses import ChatShape, Reply
from backends.openai.tool_calls import ToolReplies, tool_call_id
from backends.openai.tools import ToolChoice
from client.pieces import ResponsePiece

NAMED = ToolChoice(name="weather")
REQUIRED = ToolChoice(required=True)
CALLS = ('[ {"name": "weather", "parameters": {"city": "Pa\\"ris}", "days": [1, {"a": "]"}]}} ,'
         '{"name":"time","parameters" : {} }, {"name": "n\\u00e9ws", "parameters": {"q": "x,}"}}\n]')


def sent(body) -> dict:
    return json.loads(body.model_dump_json())


def _whole(choice: ToolChoice, text: str, reason: str = "stop", echo: str = "") -> dict:
    reply = Reply()
    reply.add(ResponsePiece(text.encode(), finish_reason=reason, num_input_tokens=5, num_output_tokens=9))
    return sent(ChatShape("tiny", False, echo=echo, tools=ToolReplies(choice)).whole([reply]))["choices"][0]


def _pieces(text: str, cuts: list[int], reason: str = "stop") -> list[ResponsePiece]:
    """``text`` cut at ``cuts`` into a stream's responses, the last bringing ``finish_reason`` alone."""
    bounds = [0, *cuts, len(text)]
    return [*(ResponsePiece(text[a:b].encode(), (1,)) for a, b in zip(bounds, bounds[1:])),
            ResponsePiece(b"", finish_reason=reason, final=True, num_input_tokens=5, num_output_tokens=9)]


def _stream(shape: ChatShape, pieces: list[ResponsePiece], index: int = 0) -> list[dict]:
    return [sent(chunk) for piece in pieces if (chunk := shape.chunk(index, piece)) is not None]


def _reassembled(chunks: list[dict]) -> list[dict]:
    """The calls the chunks' deltas make, by index, as a client puts them together (each call's first delta has
    its id, type and name; every delta a piece of its arguments)."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk["choices"][0]["delta"].get("tool_calls", []):
            if "id" in delta:
                assert delta["index"] not in calls and delta["type"] == "function" and delta["function"]["name"]
                calls[delta["index"]] = {"id": delta["id"], "type": "function",
                                         "function": {"name": delta["function"]["name"], "arguments": ""}}
            else:
                assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
            calls[delta["index"]]["function"]["arguments"] += delta["function"]["arguments"]
    return [calls[k] for k in sorted(calls)]


def test_tool_call_ids_are_vllms():
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", tool_call_id()) and tool_call_id() != tool_call_id()


def test_a_named_functions_whole_reply_is_its_call_with_the_text_as_arguments():
    choice = _whole(NAMED, ' {"city": "Paris"}')
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "weather", "arguments": ' {"city": "Paris"}'} and call["type"] == "function"
    assert choice["message"]["content"] == "" and choice["finish_reason"] == "stop"  # a named call's: the reply's


def test_a_named_reply_cut_by_max_tokens_keeps_its_text_and_an_empty_one_has_no_call():
    cut = _whole(NAMED, '{"city": "Pa', reason="length")
    assert cut["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Pa'
    assert cut["finish_reason"] == "length"
    empty = _whole(NAMED, "  ")
    assert empty["message"] == {"role": "assistant", "content": ""}  # vLLM leaves an empty tool_calls out


def test_requireds_whole_reply_is_a_call_each_with_its_parameters_written_again():
    choice = _whole(REQUIRED, CALLS)
    assert [call["function"] for call in choice["message"]["tool_calls"]] == [
        {"name": "weather", "arguments": '{"city": "Pa\\"ris}", "days": [1, {"a": "]"}]}'},
        {"name": "time", "arguments": "{}"}, {"name": "néws", "arguments": '{"q": "x,}"}'}]  # ensure_ascii=False
    assert choice["message"]["content"] == "" and choice["finish_reason"] == "tool_calls"
    assert len({call["id"] for call in choice["message"]["tool_calls"]}) == 3


@pytest.mark.parametrize("text", [CALLS[:40], '{"name": "weather"}', '[{"name": 5, "parameters": {}}]',
                                  '[{"name": "weather", "parameters": "x"}]'])
def test_a_required_reply_that_is_no_list_of_calls_has_none(text):
    """Cut by max_tokens (not JSON), or not the shape vLLM's list[FunctionDefinition] takes: no call, content ""."""
    choice = _whole(REQUIRED, text, reason="length" if text == CALLS[:40] else "stop")
    assert choice["message"] == {"role": "assistant", "content": ""}
    assert choice["finish_reason"] == ("length" if text == CALLS[:40] else "tool_calls")


def test_parallel_tool_calls_false_keeps_the_first_call():
    choice = _whole(ToolChoice(required=True, parallel=False), CALLS)
    assert [call["function"]["name"] for call in choice["message"]["tool_calls"]] == ["weather"]


def test_an_echo_is_the_content_beside_the_calls():
    assert _whole(NAMED, "{}", echo="Calling: ")["message"]["content"] == "Calling: "


def test_a_named_stream_announces_the_call_then_streams_each_chunks_text():
    shape = ChatShape("tiny", False, tools=ToolReplies(NAMED))
    chunks = _stream(shape, _pieces('{"city": "Paris"}', [3, 9]))
    first = chunks[0]["choices"][0]["delta"]
    assert first["role"] == "assistant" and "content" not in first
    assert first["tool_calls"] == [{"id": first["tool_calls"][0]["id"], "type": "function", "index": 0,
                                    "function": {"name": "weather", "arguments": '{"c'}}]
    assert chunks[1]["choices"][0]["delta"] == {"tool_calls": [{"index": 0, "function": {"arguments": 'ity": '}}]}
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "stop"]
    (call,) = _reassembled(chunks)
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}


@pytest.mark.parametrize("seed", range(40))
def test_a_required_stream_reassembles_to_the_whole_replys_calls_wherever_it_is_cut(seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(CALLS)), rng.randint(0, 30)))
    chunks = _stream(ChatShape("tiny", False, tools=ToolReplies(REQUIRED)), _pieces(CALLS, cuts))
    streamed = _reassembled(chunks)
    whole = _whole(REQUIRED, CALLS)["message"]["tool_calls"]
    assert [c["function"]["name"] for c in streamed] == [c["function"]["name"] for c in whole]
    assert [json.loads(c["function"]["arguments"]) for c in streamed] == \
        [json.loads(c["function"]["arguments"]) for c in whole]
    assert streamed[0]["function"]["arguments"] == '{"city": "Pa\\"ris}", "days": [1, {"a": "]"}]}'  # as written
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all("content" not in c["choices"][0]["delta"] for c in chunks)


def test_a_required_streams_chunks_before_a_call_has_begun_are_not_sent():
    """vLLM sends no chunk for text that is not yet a call's; the first chunk (the role) and the last (the finish
    reason) always go."""
    shape = ChatShape("tiny", False, tools=ToolReplies(REQUIRED))
    text = '[{"name": "time", "parameters": {}}]'
    chunks = _stream(shape, _pieces(text, [2, 8, 16, 29, 33]))
    assert [set(c["choices"][0]["delta"]) for c in chunks] == [{"role"}, {"tool_calls"}, {"tool_calls"}, set()]
    assert chunks[1]["choices"][0]["delta"]["tool_calls"][0]["function"] == {"name": "time", "arguments": "{"}
    with_ids = ChatShape("tiny", True, tools=ToolReplies(REQUIRED))  # token ids: every token's chunk is sent
    assert len(_stream(with_ids, _pieces(text, [2, 8, 16, 29, 33]))) == 7


def test_a_required_stream_cut_by_max_tokens_ends_with_tool_calls_once_a_call_was_streamed():
    """vLLM's streamed rule (its whole reply says "length")."""
    shape = ChatShape("tiny", False, tools=ToolReplies(REQUIRED))
    assert _stream(shape, _pieces(CALLS[:60], [30], "length"))[-1]["choices"][0]["finish_reason"] == "tool_calls"
    early = ChatShape("tiny", False, tools=ToolReplies(REQUIRED))
    assert _stream(early, _pieces(CALLS[:10], [5], "length"))[-1]["choices"][0]["finish_reason"] == "length"


def test_a_stream_of_several_choices_keeps_a_state_each_and_parallel_false_the_first_call():
    shape = ChatShape("tiny", False, n=2, tools=ToolReplies(ToolChoice(required=True, parallel=False)))
    streams = {0: [], 1: []}
    pieces = {index: _pieces(CALLS, [7 + index, 50, 90]) for index in (0, 1)}
    for step in range(len(pieces[0])):  # interleaved, as choices' responses come
        for index in (0, 1):
            if (chunk := shape.chunk(index, pieces[index][step])) is not None:
                streams[index].append(sent(chunk))
    for index, chunks in streams.items():
        assert {c["choices"][0]["index"] for c in chunks} == {index}
        (call,) = _reassembled(chunks)
        assert call["function"]["name"] == "weather"
