"""The load generator's own event loop while a scenario runs: how late it woke, so that a gap between tokens can be
told apart from a client that was busy (``timelines.token_gaps``).

One client process reads every stream of a scenario (32 at once in ``text_c32``); while its loop runs one callback
(a chunk's parse, a request's send) it reads nothing else, and a token that arrived meanwhile is stamped late. A
ticker task sleeps ``PERIOD_S`` again and again and notes how much later than asked it woke: the loop's lag, as
asyncio's debug mode measures slow callbacks (``loop.slow_callback_duration``) but without its per-callback cost.
A lag of ``STALL_MS`` or more is kept as a stall: ``[end, lag_ms]``, ``end`` on ``time.perf_counter()``'s clock,
the records' ``sent_clock_s`` scale; the loop was busy for about ``lag_ms`` before ``end``.

The load generator's heap is collected and frozen (``gc.freeze()``) before each scenario: the process imports torch
and transformers (``bench.peer.run``), about 410,000 objects the collector tracks, and a full collection of them
during a scenario held the loop for 100 ms on the CPU machine (a fake server's 32 streams x 256 chunks, one in three
passes), so every stream's next chunk was stamped that late: 32 gaps, where the TBT p99 of 32 such streams is the
82nd largest gap. Frozen, the collector skips them (the serving processes do the same, ``backends/gc_heap.py``).
The full collections that still run during the work are kept (``full_collections_ms``).

A scenario runs on uvloop (:func:`run`; libuv's event loop, the one uvicorn serves with): against that fake server
httpx then read a chunk for 57-58 us of the client's CPU instead of 88-92 on asyncio's own loop: headroom for a
client whose loop fell behind the server in 6 of 16 passes of text_c32 on an H100
(bench/results/peer/settings-h100-2026-12-06/README.md).
"""
from __future__ import annotations

import asyncio
import gc
import time
from typing import Awaitable, TypeVar

import uvloop

from bench.serve_bench import distribution

T = TypeVar("T")
PERIOD_S = 0.001
STALL_MS = 2.0


async def watched(work: Awaitable[T]) -> tuple[T, dict]:
    """``(work's result, the loop's lag while it ran)``: ``{"ticks", "lag_p99_ms", "lag_max_ms", "stalled_ms",
    "stalls": [[end_clock_s, lag_ms], ...], "frozen_objects", "full_collections_ms": [ms, ...]}`` (ms;
    ``stalled_ms``: the stalls' lags summed; ``frozen_objects``: the heap frozen before the work, module docstring;
    ``full_collections_ms``: the durations of the full garbage collections during it). Lags are measured only
    while ``work`` runs on the calling loop; ``work``'s exceptions propagate."""
    lags: list[float] = []
    stalls: list[list[float]] = []
    collections: list[float] = []
    started: list[float] = []

    def on_collection(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                started[:] = [time.perf_counter()]
            elif started:
                collections.append(round((time.perf_counter() - started[0]) * 1e3, 3))

    async def tick() -> None:
        while True:
            asked = time.perf_counter() + PERIOD_S
            await asyncio.sleep(PERIOD_S)
            woke = time.perf_counter()
            lag_ms = (woke - asked) * 1e3
            lags.append(lag_ms)
            if lag_ms >= STALL_MS:
                stalls.append([round(woke, 6), round(lag_ms, 3)])

    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    gc.callbacks.append(on_collection)
    ticker = asyncio.ensure_future(tick())
    try:
        result = await work
    finally:
        ticker.cancel()
        gc.callbacks.remove(on_collection)
        await asyncio.gather(ticker, return_exceptions=True)
    spread = distribution(lags)
    return result, {"ticks": len(lags),
                    "lag_p99_ms": round(spread["p99"], 3) if spread else None,
                    "lag_max_ms": round(spread["max"], 3) if spread else None,
                    "stalled_ms": round(sum(lag for _, lag in stalls), 3), "stalls": stalls,
                    "frozen_objects": frozen, "full_collections_ms": collections}


def overlaps(stalls: list[list[float]], start_s: float, end_s: float, min_ms: float) -> bool:
    """Whether a stall's busy span (``[end - lag, end]``) and ``[start_s, end_s]`` (``time.perf_counter()``
    seconds) share at least ``min_ms``: the loop was busy for that long within the span."""
    return any((min(end, end_s) - max(end - lag / 1e3, start_s)) * 1e3 >= min_ms for end, lag in stalls)


def run(work: Awaitable[T]) -> tuple[T, dict]:
    """:func:`watched` of ``work`` on a new uvloop event loop (module docstring), closed after."""
    return uvloop.run(watched(work))
