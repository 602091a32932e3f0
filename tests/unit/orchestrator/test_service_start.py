"""The orchestrator's start on first use: a start that failed (a stage still loading) is tried again by the next
request instead of failing every later request until a restart; a stage never loaded is named."""
import asyncio

import pytest

from backends.ipc import run_dir
from backends.ipc.link import StageError
from orchestrator import stage_clients
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


def test_a_start_without_the_stages_names_the_model_to_load(monkeypatch, tmp_path):
    """An orchestrator loaded alone (Triton's explicit model control): the first request's wait for the patch pool
    ends naming flashcodec and what to do, not only the pool's file (a fresh user's test, 2026-12-06)."""
    monkeypatch.setenv(run_dir.RUN_DIR_ENV, str(tmp_path))  # a run directory where no stage publishes
    monkeypatch.setattr(stage_clients, "PUBLISH_WAIT_S", 0.2)
    orchestrator = Orchestrator(OrchestratorConfig.from_parameters({}), metrics=None)
    with pytest.raises(StageError, match=r"^the flashcodec model is not loaded \(it publishes the patch pool\): load "
                                         r"every model of the repository \(shared pool 'patch_pool' was not published "
                                         r"within 0.2 s\)"):
        asyncio.run(orchestrator.ensure_started())
