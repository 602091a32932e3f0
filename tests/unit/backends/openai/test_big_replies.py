"""Big replies are read and written off the API process's event loop (its other requests' tokens wait for nothing
there): a whole body with many log-probability entries (backends/openai/generation.py, ``whole_body``: in a
thread, written in slices with pydantic's bytes, ``sliced_json``, sent a MiB at a time), a gRPC response with large
outputs (orchestrator_client, ``client.pieces.response_bytes``), a token channel's large items (token_channel,
``_pieces``), a JSON array written one element a line (``client.pieces.json_entries``). Small ones stay on the loop
(a thread hop costs each request)."""
from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from fastapi import Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from pydantic_core import to_json
from tritonclient.grpc import service_pb2

from backends.openai import generation
from backends.openai.responses import CompletionShape, Reply
from backends.openai import sliced_json as sliced_json_module
from backends.openai.sliced_json import SLICE, sliced_json
from backends.openai.tokenize_schemas import TokenizeResponse
from backends.openai.token_channel import _pieces
from client.pieces import LARGE_RESPONSE_BYTES, ResponsePiece, json_entries, json_output, response_bytes


def _entry(token_id: int, first: bool = False) -> dict:
    return {str(token_id): {"logprob": None if first else -1.5, "rank": None if first else 1, "decoded_token": "a"}}


class RecordingShape(CompletionShape):
    """A completions shape that notes which thread built its whole body."""

    def whole(self, replies):
        self.thread = threading.current_thread()
        return super().whole(replies)


def _reply(prompt_tokens: int) -> Reply:
    reply = Reply()
    reply.add(ResponsePiece(b"b", (7,), num_input_tokens=prompt_tokens, num_output_tokens=1, finish_reason="length",
                            final=True, prompt_logprobs=[_entry(k, k == 0) for k in range(prompt_tokens)]))
    return reply


@pytest.mark.parametrize("tokens, off_loop", [(8, False), (generation.LARGE_BODY_ENTRIES + 1, True)])
def test_a_whole_body_is_written_by_pydantic_and_off_the_loop_when_it_is_big(tokens, off_loop):
    shape = RecordingShape("tiny", False, top_logprobs=1, echo=["p"])

    async def answer() -> tuple[Response, bytes]:
        response = await generation.whole_body(shape, [_reply(tokens)])
        if isinstance(response, StreamingResponse):  # a big one: sent a MiB at a time, its length said
            content = b"".join([bytes(piece) async for piece in response.body_iterator])
            assert int(response.headers["content-length"]) == len(content)
            return response, content
        return response, response.body
    response, content = asyncio.run(answer())
    assert (shape.thread is not threading.main_thread()) == off_loop
    assert isinstance(response, StreamingResponse) == off_loop and response.media_type == "application/json"
    body = json.loads(content)
    expected = RecordingShape("tiny", False, top_logprobs=1, echo=["p"]).whole([_reply(tokens)]).model_dump()
    assert body | {"id": None, "created": None} == expected | {"id": None, "created": None}
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == tokens and logprobs["token_logprobs"][0] is None  # the echoed prompt's


@pytest.mark.parametrize("strs", [True, False])
def test_a_big_tokenize_body_is_made_off_the_loop_with_pydantics_bytes(strs):
    ids = list(range(generation.LARGE_BODY_ENTRIES + 1))
    threads = []

    def make() -> TokenizeResponse:
        threads.append(threading.current_thread())
        return TokenizeResponse(count=len(ids), max_model_len=None, tokens=ids,
                                token_strs=[f"t\u00e9{i}" for i in ids] if strs else None)

    async def answer() -> bytes:
        response = await generation.model_body(make, large=True)
        return b"".join([bytes(piece) async for piece in response.body_iterator])
    assert asyncio.run(answer()) == make().model_dump_json().encode()
    assert threads[0] is not threading.main_thread()


def test_response_bytes_counts_every_outputs_bytes():
    response = service_pb2.ModelInferResponse(raw_output_contents=[b"x" * 10, b"y" * LARGE_RESPONSE_BYTES])
    assert response_bytes(grpcclient.InferResult(response)) == LARGE_RESPONSE_BYTES + 10


def test_channel_items_become_pieces_in_order_with_their_ids():
    raw = json.dumps([{"id": "a", "text_output": "x", "output_ids": [1]},
                      {"id": "b", "text_output": "y", "output_ids": [2], "finish_reason": "stop"}]).encode()
    pieces = _pieces(raw)
    assert [(request_id, piece.text, piece.token_ids, piece.finish_reason) for request_id, piece in pieces] == [
        ("a", b"x", (1,), None), ("b", b"y", (2,), "stop")]
    assert _pieces(b"") == [] and _pieces(b"[]") == []


def test_channel_entries_take_their_prompt_ids_from_the_responses_input_ids():
    raw = json.dumps([{"id": "a", "text_output": "x", "input_ids": 3}, {"id": "b", "text_output": "y"},
                      {"id": "c", "text_output": "z", "input_ids": 1}]).encode()
    pieces = _pieces(raw, np.array([5, 6, 7, 8], dtype=np.int64))
    assert [(request_id, piece.input_ids) for request_id, piece in pieces] == [("a", (5, 6, 7)), ("b", None),
                                                                               ("c", (8,))]
    assert all(type(i) is int for i in pieces[0][1].input_ids)
    with pytest.raises(ValueError, match="an entry takes 3 input_ids past the 2 the channel response carries"):
        _pieces(raw, np.array([5, 6], dtype=np.int64))


def test_sliced_json_writes_pydantics_bytes_by_short_calls(monkeypatch):
    calls = []

    def recorded(value, **settings):
        calls.append(value)
        return to_json(value, **settings)
    monkeypatch.setattr(sliced_json_module, "to_json", recorded)
    # lists longer than a slice (the echo's entries, the prompt's), None members and fields (written as null or, for
    # the extras, left out), nested models and dicts
    shape = CompletionShape("tiny", True, top_logprobs=2, n=2, echo=["p"])
    replies = [_reply(3 * SLICE + 7), _reply(5)]
    replies[0].timeline = {"events": [{"ms": 1.5, "event": "parsed", "x": None}]}
    body = shape.whole(replies)
    assert sliced_json(body) == body.model_dump_json().encode()
    chunk = shape.chunk(0, ResponsePiece("t\u00e9".encode(), (1,),
                                          prompt_logprobs=[_entry(k, k == 0) for k in range(SLICE + 1)]))
    written = sliced_json(chunk)
    assert written == chunk.model_dump_json().encode()
    choice = json.loads(written)["choices"][0]
    assert "usage" not in json.loads(written) and choice["finish_reason"] is None and choice["stop_reason"] is None
    # no call is given a model (pydantic would write it whole) or more than a slice of a list
    assert calls and not any(isinstance(element, BaseModel) for value in calls
                             for element in (value if isinstance(value, list) else [value]))
    assert max(len(value) for value in calls if isinstance(value, list)) <= SLICE


def test_an_array_written_one_element_a_line_is_read_element_by_element():
    elements = [{"a": "line\nbreak", "b": [1, {"c": None}]}, None, "x,\ny"]
    text = "[\n" + ",\n".join(json.dumps(e) for e in elements) + "\n]"
    assert json_entries(text) == json_output(text) == json_output(text.encode()) == json.loads(text) == elements
    assert json_output("[1, 2]") == [1, 2] and json_output("") is None
    with pytest.raises(ValueError):
        json_entries("[\n1,\n2]")
