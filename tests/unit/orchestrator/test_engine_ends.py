"""The engine and a decode step that ends requests (tests/unit/orchestrator/test_engine.py's fake stages): the
requests it does not end get their tokens first, so their streams do not wait behind the ended requests' upkeep
(final responses, timelines, releases: bench/results/end-stall-cpu-2026-12-06/README.md)."""
from __future__ import annotations

import asyncio

from tests.unit.orchestrator.test_engine import World, outputs_of, run, settle


def test_a_step_hands_the_streams_going_on_their_tokens_before_the_requests_it_ends():
    async def body(w: World):
        queues = {name: w.text(name, prompt_len=10, max_tokens=3) for name in "abc"}
        for queue in queues.values():
            await outputs_of(queue, 1)
        order: list[str] = []

        async def consume(name: str) -> None:
            await queues[name].get()
            order.append(name)

        consumers = [asyncio.create_task(consume(name)) for name in "abc"]
        await settle()
        w.stages.emit(("a", 8, "length"), ("b", 8, ""), ("c", 8, "length"))
        await asyncio.wait_for(asyncio.gather(*consumers), 5)
        assert order == ["b", "a", "c"]
        w.stages.emit(("b", 9, "length"))
        await outputs_of(queues["b"], 1)
        await settle()
    run(body, prefill_budget=32)
