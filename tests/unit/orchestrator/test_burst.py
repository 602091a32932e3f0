"""A step's wait for a burst's requests still being admitted (orchestrator/burst.py)."""
from __future__ import annotations

import asyncio
import time

from orchestrator.burst import gather_burst


def _timed(admitting, waiting_tokens, wait_s: float, adds: list[float] = ()) -> tuple[float, int]:
    """Seconds gather_burst waited and the requests still being admitted then; ``adds``: when (s) a request is added
    (admitting -1, tokens +117, wake set)."""
    state = {"admitting": admitting, "tokens": waiting_tokens}

    async def main():
        wake = asyncio.Event()

        def add():
            state["admitting"] -= 1
            state["tokens"] += 117
            wake.set()
        loop = asyncio.get_running_loop()
        for at in adds:
            loop.call_later(at, add)
        started = time.monotonic()
        await gather_burst(wake, lambda: state["admitting"], lambda: state["tokens"], 2048, wait_s)
        return time.monotonic() - started, state["admitting"]
    return asyncio.run(main())


def test_off_or_nothing_being_admitted_does_not_wait():
    assert _timed(admitting=5, waiting_tokens=117, wait_s=0)[0] < 0.05
    assert _timed(admitting=0, waiting_tokens=117, wait_s=5)[0] < 0.05


def test_a_full_budget_does_not_wait():
    assert _timed(admitting=5, waiting_tokens=2048, wait_s=5)[0] < 0.05


def test_waits_until_the_burst_is_admitted():
    waited, left = _timed(admitting=3, waiting_tokens=117, wait_s=5, adds=[0.05, 0.1, 0.15])
    assert left == 0 and waited < 4


def test_waits_until_the_budget_is_full():
    # 117 + 17 x 117 = 2,106 tokens: full after the 17th of 30 admissions
    waited, left = _timed(admitting=30, waiting_tokens=117, wait_s=5, adds=[0.05 * k for k in range(1, 31)])
    assert left == 13 and waited < 4


def test_the_wait_is_bounded():
    waited, left = _timed(admitting=3, waiting_tokens=117, wait_s=0.1, adds=[1.0])
    assert left == 3 and waited < 0.9
