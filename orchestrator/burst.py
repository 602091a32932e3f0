"""A step that waits for a burst's requests still being admitted (``burst_wait_ms``; 0, the default, is off).

On the H200 (``bench/results/peer/fifth-run-2026-12-03/README.md``, 32 text requests at once) the first request of a
burst went alone in a 10-ms step, because it was the only one admitted when the engine planned; the next 17 then
prefilled in one step of 95 ms beside the first one's decode (under MPS decode's kernels run beside prefill at a
higher priority: about 22 prompt tokens/ms, against about 38 for a 2,048-token chunk alone). Waiting a few ms for the
requests that Triton has handed over but the orchestrator has not yet admitted puts them in the first step, with
nothing decoding beside it.

The wait ends as soon as no request is being admitted, or the prompts waiting for their prefill fill the step's
prefill budget (more would not go in the step anyway), or ``wait_s`` has passed. A lone request is never held: when
it is added nothing else is being admitted.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable


async def gather_burst(wake: asyncio.Event, admitting: Callable[[], int], waiting_tokens: Callable[[], int],
                       budget: int, wait_s: float) -> None:
    """Return once ``admitting()`` (requests handed over, not yet admitted or refused) is 0, ``waiting_tokens()``
    (prompt tokens waiting for prefill) reaches ``budget`` (tokens), or ``wait_s`` seconds have passed (at once when
    ``wait_s`` <= 0). ``wake`` is set whenever a request is added or an admission ends; it is cleared here."""
    deadline = time.monotonic() + wait_s
    while wait_s > 0 and admitting() > 0 and waiting_tokens() < budget:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        wake.clear()
        try:
            await asyncio.wait_for(wake.wait(), left)
        except asyncio.TimeoutError:
            return
