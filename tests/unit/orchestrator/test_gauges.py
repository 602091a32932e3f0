"""The orchestrator's gauges (orchestrator/gauges.py): many changes in one pass of the event loop make one update."""
from __future__ import annotations

import asyncio

from orchestrator.gauges import Gauges


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
