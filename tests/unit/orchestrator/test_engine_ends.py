"""The engine and a decode step that ends requests (tests/unit/orchestrator/test_engine.py's fake stages): the
requests it does not end get their tokens first, so their streams do not wait behind the ended requests' upkeep
(final responses, timelines, releases: bench/results/end-stall-cpu-2026-12-06/README.md); and the requests it ends
all hand over their last pieces before any of them is released."""
from __future__ import annotations

import asyncio

from backends.runtime.tokenizer import load_tokenizer
from orchestrator.output_processor import OutputProcessor
from orchestrator.sampling_params import RequestParams
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


def test_the_requests_a_step_ends_hand_over_their_last_pieces_before_any_release():
    """Each release (scheduler, gauges, metrics) and each consumer's upkeep of its end comes after every last
    piece of the step: the tenth ending request's last token does not wait for nine releases."""
    names = "abcdefghij"

    async def body(w: World):
        processor, events = OutputProcessor(load_tokenizer(None)), []
        w.engine.on_release = lambda released: events.append(("freed", released.req_id))
        queues = {name: w.text(name, prompt_len=10, max_tokens=3) for name in names}

        async def consume(name: str) -> None:
            async for piece in processor.stream(w.engine, name, queues[name], RequestParams(max_tokens=3)):
                if piece.reason:
                    events.append(("last", name))

        consumers = [asyncio.create_task(consume(name)) for name in names]
        await settle()
        w.stages.emit(*((name, 8, "") for name in names))
        await settle()
        w.stages.emit(*((name, 9, "length") for name in names))
        await asyncio.wait_for(asyncio.gather(*consumers), 5)
        kinds = [kind for kind, _ in events]
        assert kinds == ["last"] * len(names) + ["freed"] * len(names), events
        assert sorted(name for _, name in events[:len(names)]) == list(names)
    run(body, prefill_budget=256)
