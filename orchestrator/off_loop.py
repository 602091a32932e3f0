"""Where admission runs a request's planning, prompt building and hashing (``Orchestrator.admit``): on the event loop
or in a worker thread, by the request's size."""
from __future__ import annotations

import asyncio
import os
from typing import Callable

from orchestrator.inputs import ParsedRequest

INLINE_TEXT_CHARS = 16_384
INLINE_TOKEN_IDS = 4_096  # a token-id prompt's ids checked and decoded (prompt_text) on the loop, at most
INLINE_IMAGES = 4  # images probed and planned on the loop, at most (a header read each: about 0.1 ms)
INLINE_IMAGE_BYTES = 1 << 20  # their bytes (or files' sizes) in all, at most: BLAKE2b hashes 1 MiB in about 1 ms


def admission_runner(parsed: ParsedRequest) -> Callable:
    """How admission runs a request's planning, prompt building and hashing: on the event loop for a request with at
    most ``INLINE_TEXT_CHARS`` characters of text (building a 350-token chat prompt takes about 0.4 ms of CPU), at most
    ``INLINE_TOKEN_IDS`` token ids, and no media but at most ``INLINE_IMAGES`` images of ``INLINE_IMAGE_BYTES`` in
    all (a 1280x720 JPEG's header probe 0.08 ms, its 1,298-token chat prompt 0.18 ms, on the 2-core CPU machine); in
    a worker thread otherwise (a video's probe demuxes it). Through threads, 32 text requests arriving together
    (three hops each, interleaved under the GIL) had their prompts built 12-40 ms after they arrived on the 2-core
    CPU machine, against under 2 ms for one request alone; on the H200 beside 16 text streams an image request's
    admission through one hop took 37 ms p50 (bench/results/peer/, the seventeenth run's ``timelines.json``), where
    the work itself is under a millisecond: each time the thread gives up the GIL (a file read, the tokenizer's
    Rust) it waits for the loop's thread to hand it back."""
    text = len(parsed.text) + sum(len(part.text) for turn in parsed.turns for part in turn.parts)
    if text > INLINE_TEXT_CHARS or len(parsed.token_ids or ()) > INLINE_TOKEN_IDS or not _small_images(parsed):
        return asyncio.to_thread

    async def inline(fn: Callable, *args):
        return fn(*args)
    return inline


def _small_images(parsed: ParsedRequest) -> bool:
    """Whether ``parsed``'s media (none counts) are at most ``INLINE_IMAGES`` images of ``INLINE_IMAGE_BYTES`` in
    all (a path's file by its size; one that can no longer be read goes to the thread, whose probe names it)."""
    if len(parsed.media) > INLINE_IMAGES or any(item.kind != "image" for item in parsed.media):
        return False
    try:
        size = sum(len(item.data) if item.path is None else os.path.getsize(item.path) for item in parsed.media)
    except OSError:
        return False
    return size <= INLINE_IMAGE_BYTES
