"""Where admission builds a request's prompt (orchestrator.off_loop.admission_runner): on the event loop for a short
text-only request, in a worker thread for one with media, a long text or many token ids."""
from __future__ import annotations

import asyncio
import threading

import pytest

from orchestrator.inputs import MediaInput, ParsedRequest
from orchestrator.messages import Part, Turn
from orchestrator.sampling_params import RequestParams
from orchestrator.off_loop import INLINE_TEXT_CHARS, INLINE_TOKEN_IDS, admission_runner


def parsed(text: str = "", media: tuple[MediaInput, ...] = (), chat: str = "", ids: int = 0) -> ParsedRequest:
    turns = (Turn("user", (Part("text", chat),)),) if chat else ()
    return ParsedRequest(text, media, RequestParams(), stream=True, exclude_input_in_output=True,
                         return_output_ids=False, turns=turns, raw=not chat, token_ids=(7,) * ids if ids else None)


async def thread_of(request: ParsedRequest) -> threading.Thread:
    return await admission_runner(request)(threading.current_thread)


@pytest.mark.parametrize("request_, inline", [
    (parsed(chat="What is the capital of France?"), True),
    (parsed(text="x" * INLINE_TEXT_CHARS), True),
    (parsed(chat="y" * (INLINE_TEXT_CHARS + 1)), False),
    (parsed(chat="Describe it.", media=(MediaInput("image", b"\xff\xd8"),)), False),
    (parsed(ids=INLINE_TOKEN_IDS), True),
    (parsed(ids=INLINE_TOKEN_IDS + 1), False),
])
def test_short_text_only_requests_are_built_on_the_loop_others_in_a_thread(request_, inline):
    async def main():
        return threading.current_thread(), await thread_of(request_)
    loop_thread, ran_on = asyncio.run(main())
    assert (ran_on is loop_thread) == inline
