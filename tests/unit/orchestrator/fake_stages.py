"""In-process stages for the engine's tests: they implement ``orchestrator.stage_clients``' interfaces and record,
in one ``log``, every call in the order the engine made it, so tests can check what happened before what."""
from __future__ import annotations

import asyncio

from backends.ipc.link import StageError
from backends.ipc.protocol import (DecodeAdmit, DecodeStep, FirstToken, GroupReady, MediaDecode, StageFailure,
                                   StepPlan, StepResult)

END = object()


async def _drain(queue: asyncio.Queue):
    while (item := await queue.get()) is not END:
        if isinstance(item, StageFailure):
            raise StageError(item)
        yield item


class FakeStages:
    """encode_prefill and decode. A prompt's first token is ``first_token`` (its finish reason ``"length"`` when
    ``max_tokens`` is 1); ``fail_next_step`` makes the next step raise it; ``hold_steps`` keeps steps waiting
    until ``release_step()``. Decode steps are sent by the test with ``emit``."""

    def __init__(self, log: list, first_token: int = 7):
        self.log, self.first_token = log, first_token
        self.plans: list[StepPlan] = []
        self.max_tokens: dict[str, int] = {}
        self.fail_next_step: StageFailure | None = None
        self.hold_steps = False
        self._gate = asyncio.Event()
        self._decode: asyncio.Queue = asyncio.Queue()
        self.decoding: set[str] = set()

    async def step(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        self.log.append(("step", tuple(w.req_id for w in plan.prefill)))
        for new in plan.new:
            self.max_tokens[new.req_id] = new.max_tokens
        if self.hold_steps:
            await self._gate.wait()
            self._gate.clear()
        if self.fail_next_step is not None:
            failure, self.fail_next_step = self.fail_next_step, None
            raise StageError(failure)
        return StepResult(tuple(
            FirstToken(w.req_id, self.first_token, 0, "length" if self.max_tokens[w.req_id] == 1 else "")
            for w in plan.prefill if w.is_last))

    def release_step(self) -> None:
        self._gate.set()

    def decode_attach(self):
        self._decode.put_nowait(None)
        return _drain(self._decode)

    def emit(self, *rows: tuple[str, int, str], at: tuple[float, float] = (0.0, 0.0)) -> None:
        """One decode step: ``(seq_id, token, finish_reason)`` rows, launched and read ``at`` (``DecodeStep``'s
        ``launched_s``, ``read_s``); ended sequences leave the batch."""
        for seq_id, _, reason in rows:
            if reason:
                self.decoding.discard(seq_id)
        self._decode.put_nowait(DecodeStep(*map(tuple, zip(*rows)), *at))

    def end_decode(self, failure: StageFailure | None = None) -> None:
        self._decode.put_nowait(failure or END)

    def decode_admit(self, admit: DecodeAdmit):
        self.log.append(("admit", admit.seq_id))
        self.decoding.add(admit.seq_id)
        done: asyncio.Queue = asyncio.Queue()
        done.put_nowait(END)
        return _drain(done)

    async def decode_abort(self, seq_id: str) -> None:
        self.log.append(("decode_abort", seq_id))
        await asyncio.sleep(0)  # the decode loop acknowledges later
        self.decoding.discard(seq_id)

    def decode_pace(self, interval_ms: float, for_ms: float):
        self.log.append(("decode_pace", interval_ms, for_ms))
        done: asyncio.Queue = asyncio.Queue()
        done.put_nowait(END)
        return _drain(done)

    def decode_grow(self, grow):
        self.log.append(("decode_grow", grow.grants))
        done: asyncio.Queue = asyncio.Queue()
        done.put_nowait(END)
        return _drain(done)


class FakeMedia:
    """flashcodec: the test reports groups with ``ready`` and ends an item's call with ``finish``."""

    def __init__(self, log: list, patch_pages):
        self.log, self.patch_pages = log, patch_pages
        self.calls: dict[tuple[str, int], asyncio.Queue] = {}
        self._items: dict[str, int] = {}

    def decode(self, request: MediaDecode):
        item = self._items.get(request.req_id, 0)
        self._items[request.req_id] = item + 1
        self.log.append(("media", request.req_id, item))
        queue = self.calls[(request.req_id, item)] = asyncio.Queue()
        return _drain(queue)

    def ready(self, req_id: str, item: int, index: int, pages: int) -> None:
        """Group ``index`` decoded: its pages are taken from the shared free list, as flashcodec does."""
        self.calls[(req_id, item)].put_nowait(GroupReady(index, tuple(self.patch_pages.allocate(pages))))

    def finish(self, req_id: str, item: int, failure: StageFailure | None = None) -> None:
        self.calls[(req_id, item)].put_nowait(failure or END)

    async def abort(self, req_id: str) -> None:
        self.log.append(("media_abort", req_id))
        for (owner, _), queue in self.calls.items():
            if owner == req_id:
                queue.put_nowait(END)
