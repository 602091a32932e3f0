"""Big replies are read and written off the API process's event loop (its other requests' tokens wait for nothing
there): a whole body with many log-probability entries (backends/openai/app.py, ``_whole_body``), a gRPC response
with large outputs (orchestrator_client, ``client.pieces.response_bytes``), a token channel's large items
(token_channel, ``_pieces``). Small ones stay on the loop (a thread hop costs each request)."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2

from backends.openai import app
from backends.openai.responses import CompletionShape, Reply
from backends.openai.token_channel import _pieces
from client.pieces import LARGE_RESPONSE_BYTES, ResponsePiece, response_bytes


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


@pytest.mark.parametrize("tokens, off_loop", [(8, False), (app.LARGE_BODY_ENTRIES + 1, True)])
def test_a_whole_body_is_written_by_pydantic_and_off_the_loop_when_it_is_big(tokens, off_loop):
    shape = RecordingShape("tiny", False, top_logprobs=1, echo=["p"])
    response = asyncio.run(app._whole_body(shape, [_reply(tokens)]))
    assert (shape.thread is not threading.main_thread()) == off_loop
    assert response.media_type == "application/json"
    body = json.loads(response.body)
    expected = RecordingShape("tiny", False, top_logprobs=1, echo=["p"]).whole([_reply(tokens)]).model_dump()
    assert body | {"id": None, "created": None} == expected | {"id": None, "created": None}
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == tokens and logprobs["token_logprobs"][0] is None  # the echoed prompt's


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
