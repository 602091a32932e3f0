"""A step that waits for the rest of a burst of requests (``burst_wait_ms``; 0, the default, is off).

Triton hands the orchestrator one request per ``execute`` call, and the next call waits for the last to return and
for the GIL the event loop shares: on the H200, 32 text requests that the OpenAI API had within 3 ms reached the
orchestrator 1.1 ms apart, over 4-36 ms (the thirteenth run's timelines, bench/results/peer/thirteenth-run-2026-12-04/;
a trivial Python model behind the same tritonserver 2.51 took them 0.3-0.5 ms apart, 0.9 ms once its ``execute``
took 0.5 ms). Planned at once, the burst's steps follow that trickle: one request, then the 10 that came during its step, then
17 beside their decode (69 ms where about 45 would do alone), then 4; the 16th request's first token came with the
third step.

So a step waits while a burst is still coming: only when at least two prompts wait for their prefill (any request
before its first token with prompt tokens left, also one waiting for KV pages or for its media to be decoded; a
request alone is never held, and a burst's first request goes alone, in a prefill CUDA graph where one fits), until
the waiting prompts fill the step's prefill budget (``idle_budget_scale`` times it while nothing decodes; more would
not go in the step anyway), or no request is being admitted and none has reached the orchestrator for
:data:`QUIET_S` (the burst is over), or ``wait_s`` has passed. A slow admission (a media probe) holds such a step for
up to ``wait_s``, as it did under the rule before.

The rule before (2026-12-03) waited while any request was being admitted, from the first step on: on the H200 the
7B's first step then held two prompts, run eagerly (49 ms where one runs as a graph in 10), and the wait ended at
the first moment between two arrivals (bench/results/peer/ninth-run-2026-12-03/README.md).
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

QUIET_S = 0.003  # s without a new request after which a burst is over: about 3x the H200's 1.1-ms hand-over spacing


class Arrivals:
    """Requests Triton has handed over (:meth:`note`, on its execute thread) and those admitted or refused since
    (:meth:`settle`, on the event loop)."""

    def __init__(self) -> None:
        self.arrived = 0
        self.settled = 0
        self.last_s = float("-inf")  # time.monotonic() of the last hand-over

    def note(self, n: int) -> None:
        if n > 0:
            self.arrived += n
            self.last_s = time.monotonic()

    def settle(self) -> None:
        self.settled += 1

    def admitting(self) -> int:
        """Requests handed over and not yet admitted or refused."""
        return self.arrived - self.settled

    def coming(self, now: float) -> bool:
        """Whether more of a burst may be on its way at ``now`` (s, ``time.monotonic()``): a request is being
        admitted, or one was handed over less than :data:`QUIET_S` ago."""
        return self.admitting() > 0 or now - self.last_s < QUIET_S


async def gather_burst(wake: asyncio.Event, arrivals: Arrivals, waiting: Callable[[], tuple[int, int]],
                       budget: int, wait_s: float) -> None:
    """Return once fewer than two prompts wait (``waiting()``: prompts waiting for prefill and their tokens), their
    tokens reach ``budget``, ``arrivals`` says no more are coming (:meth:`Arrivals.coming`), or ``wait_s`` seconds
    have passed (at once when ``wait_s`` <= 0). ``wake`` is set whenever a request is added or an admission ends; it
    is cleared here."""
    now = time.monotonic()
    deadline = now + wait_s
    while now < deadline and arrivals.coming(now):
        prompts, tokens = waiting()
        if prompts < 2 or tokens >= budget:
            return
        # an admission's end sets wake; else the quiet time after the last hand-over ends the wait, unless one comes
        until = deadline if arrivals.admitting() > 0 else min(deadline, arrivals.last_s + QUIET_S)
        wake.clear()
        try:
            await asyncio.wait_for(wake.wait(), until - now)
        except asyncio.TimeoutError:
            pass
        now = time.monotonic()
