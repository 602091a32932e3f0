"""The orchestrator's responses -> the Responses API's bodies (backends/openai/responses_api/shape.py): the whole
Response object (read back with the ``openai`` SDK's own types, as the SDK reads a reply), and the stream's events
in OpenAI's and vLLM's order, numbered, named on their SSE lines, without ``[DONE]``; an error after the first
events is OpenAI's ``error`` event (the chat's stays its ``{"error": ...}`` body)."""
from __future__ import annotations

import asyncio
import json

from openai._models import construct_type
from openai.types.responses import Response, ResponseErrorEvent, ResponseStreamEvent

from backends.openai.errors import ApiError
from backends.openai.generation import _chunk_events, _events
from backends.openai.responses import ChatShape, Reply
from backends.openai.responses_api.request import ResponsesRequest
from backends.openai.responses_api.shape import ResponsesShape
from backends.openai.timing import ApiMarks
from client.pieces import ResponsePiece

LAST = dict(num_input_tokens=12, num_output_tokens=3, num_cached_tokens=8, final=True)
PIECES = [ResponsePiece(b"Hel", (1, 2)), ResponsePiece(b"", (3,)), ResponsePiece(b"lo", (4,), finish_reason="stop",
                                                                                 **LAST)]
ORDER = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
         "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
         "response.content_part.done", "response.output_item.done", "response.completed"]


def _shape(**fields) -> ResponsesShape:
    return ResponsesShape(ResponsesRequest.model_validate({"input": "Hi", **fields}), "tiny")


def _read(body, kind=Response):
    """``body`` as the SDK reads the JSON the API writes (its ``construct_type``)."""
    return construct_type(type_=kind, value=json.loads(body.model_dump_json()))


def _reply(*pieces: ResponsePiece) -> Reply:
    reply = Reply()
    for piece in pieces:
        reply.add(piece)
    return reply


def test_a_whole_reply_is_a_completed_response_with_one_message():
    shape = _shape(instructions="Be brief.", metadata={"k": "v"}, user="u1", temperature=0.0, max_output_tokens=9,
                   text={"format": {"type": "json_object"}})
    response = _read(shape.whole([_reply(*PIECES)]))
    assert response.id.startswith("resp_") and response.object == "response" and response.status == "completed"
    assert response.output_text == "Hello" and response.incomplete_details is None and response.error is None
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.status == "completed" and message.content[0].annotations == []
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (12, 3, 15)
    assert usage.input_tokens_details.cached_tokens == 8 and usage.output_tokens_details.reasoning_tokens == 0
    assert (response.model, response.instructions, response.metadata, response.user) == ("tiny", "Be brief.",
                                                                                          {"k": "v"}, "u1")
    assert (response.temperature, response.max_output_tokens, response.tool_choice, response.tools) == (0.0, 9,
                                                                                                        "none", [])
    assert response.text.format.type == "json_object"


def test_a_reply_cut_by_its_length_is_incomplete_for_max_output_tokens():
    response = _read(_shape(request_id="resp_mine").whole([_reply(PIECES[0], ResponsePiece(
        b"!", (5,), finish_reason="length", **LAST))]))
    assert response.id == "resp_mine"  # vLLM's request_id is the response's id
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.output_text == "Hel!"


def test_an_empty_reply_still_has_its_text_part():
    response = _read(_shape().whole([_reply(ResponsePiece(b"", (), finish_reason="stop", **LAST))]))
    assert response.output_text == "" and len(response.output[0].content) == 1


def test_a_stream_is_openais_events_in_order_numbered_from_zero():
    shape = _shape()
    events = [_read(event, ResponseStreamEvent) for piece in PIECES for event in shape.chunk(0, piece)]
    assert [e.type for e in events] == ORDER and [e.sequence_number for e in events] == list(range(len(ORDER)))
    created, in_progress, added, part_added, *deltas, text_done, part_done, item_done, completed = events
    assert created.response.status == in_progress.response.status == "in_progress" and created.response.output == []
    assert created.response.id == completed.response.id == shape.id
    ids = {added.item.id, part_added.item_id, text_done.item_id, part_done.item_id, item_done.item.id,
           completed.response.output[0].id, *(d.item_id for d in deltas)}
    assert ids == {shape.message_id}  # one item, one id: the SDK's stream helper checks it
    assert [d.delta for d in deltas] == ["Hel", "lo"]  # a response without text sends no delta (vLLM's)
    assert text_done.text == part_done.part.text == completed.response.output_text == "Hello"
    assert added.item.status == "in_progress" and item_done.item.status == "completed"
    assert completed.response.status == "completed" and completed.response.usage.output_tokens == 3


def test_a_stream_cut_by_its_length_ends_with_response_completed_saying_incomplete():
    """vLLM's last event whatever the status (OpenAI's is response.incomplete, which the SDK's responses.stream()
    does not take as its final response)."""
    shape = _shape()
    events = shape.chunk(0, ResponsePiece(b"Hi", (1,), finish_reason="length", **LAST))
    assert [e.type for e in events] == ORDER[:5] + ORDER[6:]  # one response: opening, its delta, closing
    assert events[-1].response.status == "incomplete" and events[-1].response.incomplete_details is not None


def test_log_probabilities_come_with_each_delta_and_the_whole_text():
    entry = {"1": {"logprob": -0.5, "rank": 2, "decoded_token": "Hel"}, "9": {"logprob": -0.1, "rank": 1,
                                                                               "decoded_token": "X"}}
    shape = _shape(include=["message.output_text.logprobs"], top_logprobs=1)
    events = shape.chunk(0, ResponsePiece(b"Hel", (1,), logprobs=[entry], finish_reason="stop", **LAST))
    delta = next(e for e in events if e.type == "response.output_text.delta")
    assert [(t.token, t.logprob, [top.token for top in t.top_logprobs]) for t in delta.logprobs] == [
        ("Hel", -0.5, ["X"])]
    assert _read(events[-1].response).output[0].content[0].logprobs[0].token == "Hel"
    assert shape.chunk_entries(0, ResponsePiece(b"", (), logprobs=[entry, entry])) == 2
    no_top = _shape(include=["message.output_text.logprobs"], top_logprobs=None)  # null: the token's alone
    (token,) = _read(no_top.whole([_reply(ResponsePiece(b"Hel", (1,), logprobs=[entry], finish_reason="stop",
                                                        **LAST))])).output[0].content[0].logprobs
    assert token.token == "Hel" and token.top_logprobs == []


def test_each_event_is_an_sse_event_named_by_its_type_and_a_chat_chunk_is_not():
    events = asyncio.run(_chunk_events(_shape(), (0, PIECES[0]), ApiMarks()))
    assert [e["event"] for e in events] == ORDER[:5]
    assert [json.loads(e["data"])["type"] for e in events] == ORDER[:5]
    (chunk,) = asyncio.run(_chunk_events(ChatShape("tiny", False), (0, PIECES[0]), ApiMarks()))
    assert set(chunk) == {"data"}
    assert ResponsesShape.done is None and ChatShape.done == "[DONE]"  # OpenAI's and vLLM's Responses streams: none


async def _stream_failing_after(shape, failure: ApiError) -> list[dict]:
    """The SSE events ``generation`` sends for a stream whose second orchestrator response is ``failure``."""
    async def pieces():
        yield 0, PIECES[1]
        raise failure

    return [event async for event in _events((0, PIECES[0]), pieces(), shape, False, ApiMarks())]


def test_an_error_after_the_first_events_is_openais_error_event_numbered_after_them():
    stopping = ApiError(503, "the server is shutting down", code="service_unavailable")
    events = asyncio.run(_stream_failing_after(_shape(), stopping))
    assert [e.get("event") for e in events] == ORDER[:5] + ["error"]  # nothing after it: no [DONE], no completed
    error = construct_type(type_=ResponseStreamEvent, value=json.loads(events[-1]["data"]))  # as the SDK reads it
    assert isinstance(error, ResponseErrorEvent) and error.sequence_number == 5
    assert json.loads(events[-1]["data"]) == {"type": "error", "sequence_number": 5, "code": "service_unavailable",
                                              "message": "the server is shutting down", "param": None}
    (failed,) = _shape().error(ApiError(500, "a stage failed"))  # no code: its kind
    assert (failed.code, failed.message, failed.sequence_number) == ("server_error", "a stage failed", 0)


def test_a_chats_error_after_its_first_chunk_stays_its_error_body_then_done():
    events = asyncio.run(_stream_failing_after(ChatShape("tiny", False), ApiError(500, "a stage failed")))
    assert all(set(e) == {"data"} for e in events) and events[-1] == {"data": "[DONE]"}
    assert json.loads(events[-2]["data"]) == {"error": {"message": "a stage failed", "type": "server_error",
                                                        "param": None, "code": None}}
