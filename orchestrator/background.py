"""An engine's background tasks (``orchestrator.engine``): calls to the stages whose replies nobody waits for, and
releases, each kept until it ends so that ``Engine.close`` can cancel it."""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Coroutine

from backends.ipc.link import StageError

log = logging.getLogger(__name__)


class Background(set):
    """The tasks running (a set of ``asyncio.Task``)."""

    def spawn(self, coroutine: Coroutine) -> None:
        """Run ``coroutine`` as a task, kept here until it ends; an unexpected exception goes to the log at once,
        not when the task is collected."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self.add(task)
        task.add_done_callback(self.discard)
        task.add_done_callback(_log_failure)


async def drain(replies: AsyncIterator, what: str) -> None:
    """Wait for a stage call's end (a pacing or pages sent to decode); a link that is gone is logged, its failure is
    the decode stream's (``Engine._follow_decode``)."""
    try:
        async for _ in replies:
            pass
    except StageError as exc:
        log.warning("orchestrator: %s not delivered (%s)", what, exc)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("orchestrator: %s failed", task.get_coro().__qualname__, exc_info=task.exception())
