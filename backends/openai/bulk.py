"""The OpenAI API process's one thread for bulk work: big answers read (their outputs parsed) and written (bodies,
chunks), off the event loop.

Python runs one thread at a time (the GIL): a thread busy with Python code gets it back from the event loop every
switch interval (5 ms), so each such thread busy beside the loop takes a share of the loop's time. Four big answers
made at once on four threads left the loop a fifth of it and stalled every stream of the process for seconds
(bench/results/big-reply-stall-cpu-2026-12-05/); made one after another on this thread, they leave it half.
"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")
_THREAD = ThreadPoolExecutor(1, "api-bulk")


async def in_bulk_thread(fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` on the bulk thread, after the bulk work queued before it."""
    return await asyncio.get_running_loop().run_in_executor(_THREAD, functools.partial(fn, *args))
