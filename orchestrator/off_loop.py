"""Where admission runs a request's planning, prompt building and hashing (``Orchestrator.admit``): on the event loop
or in a worker thread, by the request's size."""
from __future__ import annotations

import asyncio
from typing import Callable

from orchestrator.inputs import ParsedRequest

INLINE_TEXT_CHARS = 16_384
INLINE_TOKEN_IDS = 4_096  # a token-id prompt's ids checked and decoded (prompt_text) on the loop, at most


def admission_runner(parsed: ParsedRequest) -> Callable:
    """How admission runs a request's planning, prompt building and hashing: on the event loop for a request with no
    media, at most ``INLINE_TEXT_CHARS`` characters of text (building a 350-token chat prompt takes about 0.4 ms of
    CPU) and at most ``INLINE_TOKEN_IDS`` token ids, in a worker thread otherwise. Through threads, 32 text requests
    arriving together (three hops each, interleaved under the GIL) had their prompts built 12-40 ms after they
    arrived on the 2-core CPU machine, against under 2 ms for one request alone. Small images stay in the thread
    too, though an ordinary one's probe and prompt take under a millisecond: Pillow reads a header in Python, and a
    crafted image of under 1 MiB took it up to 1.6 s (a GIF of 200,000 comment blocks); on the event loop that
    stopped every stream for as long, in the thread for about 100 ms (a fresh user's break test, 2026-12-06)."""
    text = len(parsed.text) + sum(len(part.text) for turn in parsed.turns for part in turn.parts)
    if parsed.media or text > INLINE_TEXT_CHARS or len(parsed.token_ids or ()) > INLINE_TOKEN_IDS:
        return asyncio.to_thread

    async def inline(fn: Callable, *args):
        return fn(*args)
    return inline
