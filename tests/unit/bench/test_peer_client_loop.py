"""The load generator's loop lag (bench/peer/client_loop.py): a callback that holds the loop shows as a stall on the
records' clock; the work's result and exceptions pass through."""
from __future__ import annotations

import asyncio
import gc
import time

import pytest

from bench.peer import client_loop


def test_a_blocked_loop_is_a_stall_and_the_result_comes_back():
    async def work() -> str:
        await asyncio.sleep(0.01)
        blocked_from = time.perf_counter()
        time.sleep(0.03)  # a callback holding the loop 30 ms
        await asyncio.sleep(0.01)
        return f"{blocked_from}"

    result, lag = asyncio.run(client_loop.watched(work()))
    blocked_from = float(result)
    assert lag["ticks"] > 0 and lag["lag_max_ms"] >= 25.0 and lag["stalled_ms"] >= 25.0
    assert client_loop.overlaps(lag["stalls"], blocked_from, blocked_from + 0.03, 25.0)
    assert not client_loop.overlaps(lag["stalls"], blocked_from + 1.0, blocked_from + 2.0, 2.0)
    end, lag_ms = max(lag["stalls"], key=lambda stall: stall[1])
    assert not client_loop.overlaps([[end, lag_ms]], end - 0.001, end + 1.0, 2.0)  # 1 ms of it in the span


def test_the_works_exception_propagates_and_the_ticker_stops():
    async def failing() -> None:
        await asyncio.sleep(0.005)
        raise ValueError("boom")

    async def main() -> None:
        with pytest.raises(ValueError, match="boom"):
            await client_loop.watched(failing())
        assert len(asyncio.all_tasks()) == 1  # only main: the ticker was cancelled

    asyncio.run(main())


def test_the_heap_is_frozen_before_the_work_and_its_full_collections_are_kept():
    """Objects alive before the work are frozen (a full collection skips them); a full collection during the work
    is listed with its duration (ms)."""
    kept = [[n] for n in range(1000)]  # tracked objects alive before the work
    callbacks_before = len(gc.callbacks)

    async def work() -> int:
        frozen = gc.get_freeze_count()
        gc.collect()  # a full collection during the work
        return frozen

    try:
        frozen, lag = asyncio.run(client_loop.watched(work()))
        # not equal: a frozen object freed by its reference count leaves the permanent generation (the full suite's
        # count fell by 10 between the freeze and the work once)
        assert frozen >= len(kept) and lag["frozen_objects"] >= len(kept)
        assert len(lag["full_collections_ms"]) == 1 and lag["full_collections_ms"][0] >= 0.0
        assert len(gc.callbacks) == callbacks_before  # its callback removed
    finally:
        gc.unfreeze()


def test_run_watches_the_work_on_a_uvloop_loop():
    async def work() -> str:
        await asyncio.sleep(0.005)
        return type(asyncio.get_running_loop()).__module__

    module, lag = client_loop.run(work())
    assert module.startswith("uvloop") and lag["ticks"] > 0
