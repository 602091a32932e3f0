"""The load generator's own event loop while a scenario runs: how late it woke, so that a gap between tokens can be
told apart from a client that was busy (``timelines.token_gaps``).

One client process reads every stream of a scenario (32 at once in ``text_c32``); while its loop runs one callback
(a chunk's parse, a request's send) it reads nothing else, and a token that arrived meanwhile is stamped late. A
ticker task sleeps ``PERIOD_S`` again and again and notes how much later than asked it woke: the loop's lag, as
asyncio's debug mode measures slow callbacks (``loop.slow_callback_duration``) but without its per-callback cost.
A lag of ``STALL_MS`` or more is kept as a stall: ``[end, lag_ms]``, ``end`` on ``time.perf_counter()``'s clock,
the records' ``sent_clock_s`` scale; the loop was busy for about ``lag_ms`` before ``end``.
"""
from __future__ import annotations

import asyncio
import time
from typing import Awaitable, TypeVar

from bench.serve_bench import distribution

T = TypeVar("T")
PERIOD_S = 0.001
STALL_MS = 2.0


async def watched(work: Awaitable[T]) -> tuple[T, dict]:
    """``(work's result, the loop's lag while it ran)``: ``{"ticks", "lag_p99_ms", "lag_max_ms", "stalled_ms",
    "stalls": [[end_clock_s, lag_ms], ...]}`` (ms; ``stalled_ms``: the stalls' lags summed). Lags are measured only
    while ``work`` runs on the calling loop; ``work``'s exceptions propagate."""
    lags: list[float] = []
    stalls: list[list[float]] = []

    async def tick() -> None:
        while True:
            asked = time.perf_counter() + PERIOD_S
            await asyncio.sleep(PERIOD_S)
            woke = time.perf_counter()
            lag_ms = (woke - asked) * 1e3
            lags.append(lag_ms)
            if lag_ms >= STALL_MS:
                stalls.append([round(woke, 6), round(lag_ms, 3)])

    ticker = asyncio.ensure_future(tick())
    try:
        result = await work
    finally:
        ticker.cancel()
        await asyncio.gather(ticker, return_exceptions=True)
    spread = distribution(lags)
    return result, {"ticks": len(lags),
                    "lag_p99_ms": round(spread["p99"], 3) if spread else None,
                    "lag_max_ms": round(spread["max"], 3) if spread else None,
                    "stalled_ms": round(sum(lag for _, lag in stalls), 3), "stalls": stalls}


def overlaps(stalls: list[list[float]], start_s: float, end_s: float, min_ms: float) -> bool:
    """Whether a stall's busy span (``[end - lag, end]``) and ``[start_s, end_s]`` (``time.perf_counter()``
    seconds) share at least ``min_ms``: the loop was busy for that long within the span."""
    return any((min(end, end_s) - max(end - lag / 1e3, start_s)) * 1e3 >= min_ms for end, lag in stalls)
