"""The orchestrator's start on first use: a start that failed (a stage still loading) is tried again by the next
request instead of failing every later request until a restart."""
import asyncio

import pytest

from orchestrator.config import OrchestratorConfig
from orchestrator.service import Orchestrator


def test_a_failed_start_is_tried_again_by_the_next_request(monkeypatch):
    orchestrator = Orchestrator(OrchestratorConfig.from_parameters({}), metrics=None)
    attempts = []

    async def start():
        attempts.append(len(attempts))
        await asyncio.sleep(0.01)
        if len(attempts) == 1:
            raise TimeoutError("shared pool 'patch_pool' was not published")

    monkeypatch.setattr(orchestrator, "_start", start)

    async def requests():
        first = await asyncio.gather(orchestrator.ensure_started(), orchestrator.ensure_started(),
                                     return_exceptions=True)
        assert [type(e) for e in first] == [TimeoutError, TimeoutError]  # both waited for the one start
        await orchestrator.ensure_started()  # tried again, and it succeeds
        await orchestrator.ensure_started()  # started: not again

    asyncio.run(requests())
    assert attempts == [0, 1]


def test_a_cancelled_start_is_tried_again(monkeypatch):
    orchestrator = Orchestrator(OrchestratorConfig.from_parameters({}), metrics=None)
    attempts = []

    async def start():
        attempts.append(1)
        if len(attempts) == 1:
            raise asyncio.CancelledError

    monkeypatch.setattr(orchestrator, "_start", start)

    async def requests():
        with pytest.raises(asyncio.CancelledError):
            await orchestrator.ensure_started()
        await orchestrator.ensure_started()

    asyncio.run(requests())
    assert len(attempts) == 2
