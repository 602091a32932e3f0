"""The orchestrator's gauges (orchestrator/gauges.py): many changes in one pass of the event loop make one update."""
from __future__ import annotations

import asyncio

from backends.ipc.protocol import SERVER_FAULT, StageFailure
from orchestrator.gauges import GROWTH_WITHIN_S, Gauges
from tests.unit.orchestrator.test_engine import World, outputs_of, run


def test_changes_in_one_pass_of_the_loop_make_one_update():
    updates = []

    async def main():
        gauges = Gauges(metrics=None, source=lambda: ([], None))
        gauges.update = lambda: (updates.append(1), setattr(gauges, "_due", False))
        for _ in range(17):  # a step that ended 17 prompts
            gauges.changed()
        assert updates == []  # not during the pass that made the changes
        await asyncio.sleep(0)
        assert updates == [1]
        gauges.changed()  # a later pass: a new update
        await asyncio.sleep(0)
        assert updates == [1, 1]

    asyncio.run(main())


class Recorded:
    """``Metrics``' setter, recording the last value of each (gauge, replica)."""

    def __init__(self):
        self.values = {}

    def set(self, name, value, replica=None):
        self.values[name, replica] = value

    def increment(self, name, by=1, label=None):
        pass


def test_a_replica_whose_decode_stream_ended_shows_as_not_serving():
    async def body(w: World):
        metrics = Recorded()
        gauges = Gauges(metrics, lambda: ([w.engine], w.patch))
        gauges.update()
        assert metrics.values["unifiedserve_replica_serving", 0] == 1.0
        out = w.text("a", max_tokens=100)
        await outputs_of(out, 1)
        w.stages.end_decode(StageFailure(SERVER_FAULT, "decode: the stage closed its link"))
        await outputs_of(out, 1)
        gauges.update()
        assert metrics.values["unifiedserve_replica_serving", 0] == 0.0
    run(body)


def test_a_replica_shows_as_not_serving_once_the_server_stops():
    """The server's stop (a stage unloaded alone by Triton's model control, too: the orchestrator serves nothing
    after it) takes the replica's gauge to 0, so the OpenAI API's /health answers 503 (it stayed 1)."""
    async def body(w: World):
        metrics = Recorded()
        w.engine.on_change = lambda grew=False: Gauges(metrics, lambda: ([w.engine], w.patch)).update()
        w.engine.stop()
        assert metrics.values["unifiedserve_replica_serving", 0] == 0.0
    run(body)


def test_kv_pages_granted_to_growing_replies_show_in_the_gauges_soon():
    """A reply's KV pages are granted as it grows, no request waiting for one: the page gauges follow within
    GROWTH_WITHIN_S (they kept the admission's figures until a request waited for a page or ended: a fresh user's
    4 replies of 3,000 tokens read 18 pages taken all along), one update for many steps' grants."""
    async def body(w: World):
        metrics, updates = Recorded(), []
        gauges = Gauges(metrics, lambda: ([w.engine], w.patch))
        update = gauges.update
        gauges.update = lambda: (updates.append(1), update())
        w.engine.on_change = gauges.changed
        out = w.text("a", prompt_len=20, max_tokens=200)
        await outputs_of(out, 1)
        await asyncio.sleep(2 * GROWTH_WITHIN_S)
        admitted, before = metrics.values["unifiedserve_kv_pages_free", None], len(updates)
        for token in range(100):  # 120 tokens of KV: 8 pages, from the admission's 4 (its prompt's 2 and 2 more)
            w.stages.emit(("a", token, ""))
        await outputs_of(out, 100)
        assert w.kv.num_free < 32 - 4
        await asyncio.sleep(2 * GROWTH_WITHIN_S)
        assert metrics.values["unifiedserve_kv_pages_free", None] == w.kv.num_free < admitted
        assert len(updates) - before <= 2  # the grants of 100 steps in one pass (or two): not an update each
        w.stages.emit(("a", 100, "length"))
        await outputs_of(out, 1)
    run(body)
