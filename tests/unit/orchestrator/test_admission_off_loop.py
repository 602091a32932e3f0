"""Where admission builds a request's prompt (orchestrator.off_loop.admission_runner): on the event loop for a short
request with at most a few small images, in a worker thread for one with a video, many or large images, a long text
or many token ids."""
from __future__ import annotations

import asyncio
import threading

import pytest

from orchestrator.inputs import MediaInput, ParsedRequest
from orchestrator.messages import Part, Turn
from orchestrator.sampling_params import RequestParams
from orchestrator.off_loop import (INLINE_IMAGE_BYTES, INLINE_IMAGES, INLINE_TEXT_CHARS, INLINE_TOKEN_IDS,
                                  admission_runner)


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
    (parsed(chat="Describe it.", media=(MediaInput("image", b"\xff\xd8"),)), True),
    (parsed(chat="Describe it.", media=(MediaInput("image", b"\xff" * INLINE_IMAGE_BYTES),)), True),
    (parsed(chat="Describe it.", media=(MediaInput("image", b"\xff" * (INLINE_IMAGE_BYTES + 1)),)), False),
    (parsed(chat="Describe them.", media=(MediaInput("image", b"\xff\xd8"),) * INLINE_IMAGES), True),
    (parsed(chat="Describe them.", media=(MediaInput("image", b"\xff\xd8"),) * (INLINE_IMAGES + 1)), False),
    (parsed(chat="Describe it.", media=(MediaInput("video", b"\x00\x00"),)), False),
    (parsed(chat="Describe it.", media=(MediaInput("image", path="/no/such/file.jpg"),)), False),
    (parsed(ids=INLINE_TOKEN_IDS), True),
    (parsed(ids=INLINE_TOKEN_IDS + 1), False),
])
def test_short_requests_with_few_small_images_are_built_on_the_loop_others_in_a_thread(request_, inline):
    async def main():
        return threading.current_thread(), await thread_of(request_)
    loop_thread, ran_on = asyncio.run(main())
    assert (ran_on is loop_thread) == inline


def test_an_image_file_counts_by_its_size(tmp_path):
    small, large = tmp_path / "small.jpg", tmp_path / "large.jpg"
    small.write_bytes(b"\xff" * INLINE_IMAGE_BYTES)
    large.write_bytes(b"\xff" * (INLINE_IMAGE_BYTES + 1))

    async def main(path):
        request = parsed(chat="Describe it.", media=(MediaInput("image", path=str(path)),))
        return threading.current_thread(), await thread_of(request)
    for path, inline in ((small, True), (large, False)):
        loop_thread, ran_on = asyncio.run(main(path))
        assert (ran_on is loop_thread) == inline
