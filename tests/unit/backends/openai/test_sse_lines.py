"""A streamed chunk's JSON stays on one line for clients that split the stream with ``str.splitlines`` (httpx's
``aiter_lines``): U+0085, U+2028 and U+2029, which a token's text may hold and pydantic writes as they are, go out as
JSON escapes (backends/openai/generation.py, ``one_line``)."""
from __future__ import annotations

import asyncio
import json

import pytest
from httpx._decoders import LineDecoder
from sse_starlette.sse import ServerSentEvent

from backends.openai.generation import _chunk_events, one_line
from backends.openai.responses import ChatShape
from backends.openai.timing import ApiMarks
from client.pieces import ResponsePiece


@pytest.mark.parametrize("text", ["a\u2028b", "a\x85b", "a\u2029b", "\u2028\u2028", "plain", "caf\u00e9 \u4e2d"])
def test_a_chunk_with_a_splitlines_break_in_its_text_is_one_sse_data_line(text):
    piece = ResponsePiece(text.encode(), (7,), num_input_tokens=3, num_output_tokens=1)
    (event,) = asyncio.run(_chunk_events(ChatShape("tiny", False), (0, piece), ApiMarks()))
    data = event["data"]
    lines = [line for line in LineDecoder().decode(ServerSentEvent(data=data, sep="\n").encode().decode()) if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: "):])["choices"][0]["delta"]["content"] == text


def test_ascii_json_is_left_as_it_is():
    text = '{"a": "b\\u2028"}'
    assert one_line(text) is text
