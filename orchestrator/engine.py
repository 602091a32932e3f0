"""One replica's engine: the states of its requests, its scheduler's step loop, the handoff from prefill to
decode, and the order in which a request's work is stopped before its pages are returned.

A request goes WAITING (no KV pages yet) -> ENCODING (its next prompt tokens wait for media groups) or
PREFILLING -> DECODING (its first token came from the prefill step; the engine hands it to decode at once) ->
FINISHED. Its tokens, each with the finish reason the stage that sampled it gave (the stop rule is applied
where tokens are sampled), and at most one failure go to the request's output queue, read by
``orchestrator.output_processor``.

Pages (docs/design.md, invariant 2): a request's KV and patch pages return only once no stage can write them:
after decode has acknowledged its abort (or sent its last row) and after its flashcodec calls have ended.
The engine knows the stages only through ``orchestrator.stage_clients``' interfaces, so its tests use fakes.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import AsyncIterator, Callable, Iterable, Iterator

from backends.ipc.link import StageError
from backends.ipc.protocol import (SERVER_FAULT, DecodeAdmit, DecodeGrow, DecodeStep, FirstToken, StageFailure,
                                   StepPlan)
from flashcodec.families import family_of
from orchestrator.background import Background, drain
from orchestrator.budget_policy import BudgetPolicy, Waiting, work_units
from orchestrator.burst import Arrivals, gather_burst
from orchestrator.decode_pace import PACE_FOR_MS, DecodePacer, Joins
from orchestrator.engine_io import (SHUTTING_DOWN, EngineRequest, Output, Released, RequestState, Tracked,
                                   failure_of)
from orchestrator.fewer_sms import FewerSms
from orchestrator.media_task import run_media
from orchestrator.pages import PagePool
from orchestrator.scheduler import Scheduler
from orchestrator.sequence import Sequence
from orchestrator.stage_clients import MediaStage, ReplicaStages
from orchestrator.timeline import NO_TIMELINE, mark_steps

log = logging.getLogger(__name__)


class Engine:
    """Replica ``index``: ``scheduler`` (its KV page table; the shared patch pool ``patch_pages``), ``stages`` and the
    shared ``media`` stage. ``on_change(grew)`` after pages or requests changed (gauges), ``on_step(paced)`` after each
    executed step, ``on_release(Released)`` per request released; ``stopping()`` says whether the server has begun to
    stop (a media stream that ends early then fails its request as shutting down, not as bad input); ``policy`` sets
    each step's budgets from the measured decode gaps and step times (None: the scheduler's configured budgets);
    ``arrivals``: the requests Triton has handed over, for the rest of which a step may wait (``burst_wait_ms``:
    ``orchestrator.burst``); ``pacer`` spaces decode's steps while a step that ends image prompts, or more prompts
    than decode holds, runs (``orchestrator.decode_pace``; None: never); ``fewer_sms`` marks the steps the stage runs
    on fewer SMs (``orchestrator.fewer_sms``); ``joins``: how decode meets a step's new sequences (``Joins``)."""

    def __init__(self, index: int, scheduler: Scheduler, patch_pages: PagePool, stages: ReplicaStages,
                 media: MediaStage, on_change: Callable[..., None] = lambda grew=False: None,
                 on_step: Callable[[bool], None] = lambda paced: None,
                 on_release: Callable[[Released], None] = lambda released: None,
                 stopping: Callable[[], bool] = lambda: False, policy: BudgetPolicy | None = None,
                 arrivals: Arrivals | None = None, pacer: DecodePacer | None = None,
                 fewer_sms: FewerSms = FewerSms(), joins: Joins = Joins()):
        self.index, self.scheduler, self.patch_pages = index, scheduler, patch_pages
        self.stages, self.media = stages, media
        self.on_change, self.on_step, self.on_release, self.server_stopping = on_change, on_step, on_release, stopping
        self.requests: dict[str, Tracked] = {}
        self.wake = asyncio.Event()
        self.decode_ended: str | None = None  # why the decode stream has ended, once it has
        self.stopping = False
        self._loops: list[asyncio.Task] = []
        self._background = Background()
        self.policy = policy  # each step's budgets, when SLO scheduling is on
        self.arrivals = arrivals or Arrivals()  # requests handed over by Triton (all replicas)
        self.pacer, self.fewer_sms, self.joins = pacer, fewer_sms, joins
        self._last_decode = 0.0  # when the last decode step with sequences arrived (time.monotonic() seconds)

    # ---- life -------------------------------------------------------------------------------------------
    async def start(self, timeout_s: float = 60.0) -> None:
        """Attach to decode's step stream and start the step loop; raises StageError when decode cannot be
        reached, TimeoutError when it does not answer within ``timeout_s`` seconds."""
        attached = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._loops = [loop.create_task(self._follow_decode(attached)), loop.create_task(self._step_loop())]
        self._loops[1].add_done_callback(self._step_loop_died)
        await asyncio.wait_for(attached.wait(), timeout_s)
        if self.decode_ended:
            raise StageError(StageFailure(SERVER_FAULT, self.decode_ended))

    def stop(self) -> None:
        """The server is stopping: fail every request now and start nothing new; no abort goes to the stages,
        which end their own work."""
        self.stopping = True
        for tracked in list(self.requests.values()):
            self.fail(tracked, StageFailure(SERVER_FAULT, SHUTTING_DOWN))
        self.wake.set()
        self.on_change()  # its replica_serving gauge goes to 0 (orchestrator.gauges)

    def busy(self) -> bool:
        """A request, a loop or a release is still going."""
        return bool(self.requests) or any(not t.done() for t in (*self._loops, *self._background))

    async def close(self) -> None:
        """Cancel the loops, media calls and releases (for ``finalize``)."""
        self.stopping = True
        tasks = [*self._loops, *self._background, *(t for r in self.requests.values() for t in r.media_tasks)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- requests ---------------------------------------------------------------------------------------
    def add(self, request: EngineRequest) -> asyncio.Queue:
        """Queue ``request`` (its media decodes start now); returns its output queue of ``Output``. Raises
        ValueError (from the scheduler) when its KV pages could never fit."""
        new = request.new
        seq = Sequence(new.req_id, len(new.input_ids), new.max_tokens, list(request.groups), request=new,
                       block_hashes=request.block_hashes, reads_cache=new.sampling.prompt_logprobs is None)
        self.scheduler.add(seq)
        calls = []
        for item, call in enumerate(request.media):
            # admitted at once with groups of the item in its cached prefix: only the others are decoded
            first = min((g.index for g in seq.groups if g.item == item and not g.encoded), default=None)
            if first is None:
                continue
            if first and call.plan.kind == "video":
                try:
                    call = replace(call, plan=family_of(call.plan).video_groups_from(call.plan, first))
                except Exception:
                    self.scheduler.remove(new.req_id)  # its pages (shared ones included) go back before the error
                    self._grow()
                    raise
            else:  # an image (InternVL3: a group a tile) is decoded whole; its cached groups are reported "cached"
                first = 0
            calls.append((item, call, first))
        tracked = self.requests[new.req_id] = Tracked(request)
        request.timeline.mark("engine_added", replica=self.index, cached_tokens=seq.num_cached_tokens)
        loop = asyncio.get_running_loop()
        for item, call, first in calls:
            replies = self.media.decode(call)  # queued now: an abort made later cannot overtake it
            tracked.media_tasks.append(loop.create_task(run_media(self, tracked, item, replies, first)))
        self.wake.set()
        self.on_change()
        return tracked.outputs

    def state(self, req_id: str) -> RequestState:
        tracked, seq = self.requests.get(req_id), self.scheduler.get(req_id)
        if tracked is None or tracked.releasing or seq is None:
            return RequestState.FINISHED
        if tracked.in_decode:
            return RequestState.DECODING
        if seq.block_table is None:
            return RequestState.WAITING
        return RequestState.PREFILLING if seq.prefill_end() > seq.num_computed_tokens else RequestState.ENCODING

    async def abort(self, req_id: str) -> None:
        """Stop the request's work and return its pages (cancelled, a stop string, its client gone); nothing if
        it has already been released. Returns once its pages are free, unless a release was already under way."""
        tracked = self.requests.get(req_id)
        if tracked is not None:
            await self._release(tracked)

    async def _release(self, tracked: Tracked) -> None:
        """Abort, then free (idempotent): decode drops the sequence and flashcodec's calls end before the
        scheduler returns the request's pages."""
        if tracked.releasing:
            return
        tracked.releasing = True
        req_id = tracked.request.new.req_id
        self.scheduler.hold(req_id)  # no more steps for it while the stages let go of it
        if not self.stopping:  # stopping: the stages end their work themselves and no page is reused
            if tracked.decoding:
                await self._quietly(self.stages.decode_abort(req_id))
            if any(not task.done() for task in tracked.media_tasks):
                await self._quietly(self.media.abort(req_id))
                await asyncio.gather(*tracked.media_tasks, return_exceptions=True)
        del self.requests[req_id]
        self.scheduler.remove(req_id)  # returns the patch pages of groups decoded but not yet encoded
        if not self.stopping and not self.decode_ended:  # pages back: a sequence in decode may have its next one
            self._grow()
        self.on_release(Released(req_id, tracked.patch_pages_peak, bool(tracked.request.media), tracked.admitted,
                                 tracked.scheduled, tracked.first_token, tracked.last_token))
        self.on_change()
        self.wake.set()

    @staticmethod
    async def _quietly(call) -> None:
        """An abort to a stage whose link is gone (its process ended) writes no page any more, so the pages may
        be returned all the same (logged)."""
        try:
            await call
        except StageError as exc:
            log.warning("orchestrator: abort not delivered (%s); the stage has gone, its pages are returned", exc)

    def _end(self, tracked: Tracked, output: Output) -> None:
        """Queue a request's last output and release it."""
        if tracked.end(output):
            self._background.spawn(self._release(tracked))

    def fail(self, tracked: Tracked, failure: StageFailure) -> None:
        self._end(tracked, Output(failure=failure))

    def live(self, req_id: str) -> Tracked | None:
        """The request, unless it has ended or is being released (then nothing new may start for it)."""
        tracked = self.requests.get(req_id)
        return None if tracked is None or tracked.ended or tracked.releasing else tracked

    # ---- the step loop ----------------------------------------------------------------------------------
    async def _step_loop(self) -> None:
        while not self.stopping:
            config, decoding = self.scheduler.config, any(t.decoding for t in self.requests.values())
            enough = config.prefill_budget if self.policy else config.step_budgets(decoding)[1]  # tokens
            await gather_burst(self.wake, self.arrivals, self._prompts_waiting, enough, config.burst_wait_ms / 1e3)
            decoding = any(t.decoding for t in self.requests.values())
            plan = self.scheduler.schedule(self._budgets(), decode_running=decoding)
            if plan is None:
                self.wake.clear()
                await self.wake.wait()
                continue
            launched = time.monotonic()
            for new in plan.new:  # a request is in `new` in the first step with work for it
                if (tracked := self.requests.get(new.req_id)) is not None:
                    tracked.scheduled = launched
            kinds = self._decoding_kinds()
            joining = sum(tracked.joining for tracked in self.requests.values()) if self.joins.hold else 0
            paced, held = self.joins.pacing(self.pacer, plan, kinds, joining, self._kind_of)  # ms; decode_pace.py
            if held:
                self._tell_decode(paced, PACE_FOR_MS)
            try:
                await self._step(plan, launched, paced, self.fewer_sms(plan, kinds, self._kind_of))
            finally:
                if held and not self.stopping:  # stopping: decode's stream ends, its pacing with it
                    self._tell_decode(0.0, 0.0)

    async def _step(self, plan: StepPlan, launched: float, paced: float, fewer_sms: bool) -> None:
        """Run ``plan`` (sent marked ``fewer_sms`` when so), complete it and hand its first tokens to decode; a
        failed step fails its requests and leaves the loop (and the server) alive."""
        try:
            result = await self.stages.step(replace(plan, fewer_sms=True) if fewer_sms else plan)
        except Exception as exc:
            failure = failure_of(exc, "scheduler step failed")
            for req_id in dict.fromkeys(w.req_id for w in (*plan.encode, *plan.prefill)):
                self.scheduler.remove(req_id)  # its pages come back when the plan completes
                if (tracked := self.live(req_id)) is not None:
                    self.fail(tracked, failure)
            self.scheduler.complete(plan)
            self._grow()
            self.on_change()
            return
        self.scheduler.complete(plan)
        self._grow()
        self.on_step(bool(paced))
        if self.policy is not None:
            self.policy.observe_step((time.monotonic() - launched) * 1e3,
                                     work_units(plan.num_prefill_tokens, plan.num_encode_patches))
        for work in plan.encode:  # the scheduler returned these groups' patch pages
            if (tracked := self.requests.get(work.req_id)) is not None:
                tracked.patch_pages_held -= len(work.patch_pages)
        mark_steps(plan, lambda req_id: (t.request.timeline if (t := self.requests.get(req_id)) else NO_TIMELINE),
                   launched, result)
        for first in result.first_tokens:
            self._first_token(first)
        self.on_change()

    def _kind_of(self, req_id: str) -> str | None:
        """A request's modality; None when it has gone."""
        return tracked.request.kind if (tracked := self.requests.get(req_id)) is not None else None

    def _decoding_kinds(self) -> list[str]:
        """The modality of each request in the decode batch."""
        return [tracked.request.kind for tracked in self.requests.values() if tracked.decoding]

    def _tell_decode(self, interval_ms: float, for_ms: float) -> None:
        """Queue a pacing for decode now (in order with the admits and aborts sent to it); a link that is gone is
        the decode stream's failure, seen by ``_follow_decode``."""
        self._background.spawn(drain(self.stages.decode_pace(interval_ms, for_ms), "decode's pacing"))

    def _before_first_token(self) -> Iterator[tuple[Tracked, Sequence]]:
        """The requests before their first token (none of them decoding), each with its scheduler sequence."""
        for tracked in self.requests.values():
            if not tracked.first_token and (seq := self.scheduler.get(tracked.request.new.req_id)) is not None:
                yield tracked, seq

    def _prompts_waiting(self) -> tuple[int, int]:
        """The requests before their first token with prompt tokens still to prefill, and those tokens."""
        left = [seq.prompt_len - seq.num_computed_tokens for _, seq in self._before_first_token()]
        return sum(n > 0 for n in left), sum(left)

    def _budgets(self) -> tuple[int, int] | None:
        """The policy's budgets for the next step, from the modalities decoding and the requests before their first
        token; None without a policy."""
        if self.policy is None:
            return None
        now = time.monotonic()
        decoding = set(self._decoding_kinds())
        waiting = [Waiting(tracked.request.kind, (now - tracked.admitted) * 1e3,
                           work_units(seq.prompt_len - seq.num_computed_tokens, seq.patches_left))
                   for tracked, seq in self._before_first_token()]
        return self.policy.budgets(decoding, waiting)

    def _step_loop_died(self, task: asyncio.Task) -> None:
        """A bug that ended the step loop takes the replica out of routing and fails its requests, not hangs them."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("orchestrator: the step loop of replica %d failed", self.index, exc_info=task.exception())
        self.decode_ended = self.decode_ended or f"internal error: the step loop failed: {task.exception()!r}"
        for tracked in list(self.requests.values()):
            self.fail(tracked, StageFailure(SERVER_FAULT, self.decode_ended))

    def _first_token(self, first: FirstToken) -> None:
        """Hand the sequence to decode before its first token goes out (so any abort the token may cause is sent
        after the admit), or end it there."""
        tracked = self.live(first.req_id)
        if tracked is None:
            return
        tracked.first_token = tracked.last_token = time.monotonic()
        tracked.request.timeline.mark("first_token", at=tracked.first_token)
        if (seq := self.scheduler.get(first.req_id)) is not None:
            tracked.request.counts.cached_tokens = seq.num_cached_tokens
        tracked.mrope_delta = first.mrope_delta
        if first.finish_reason:
            self._end(tracked, Output.last(first.token, first.finish_reason, first.logprobs, first.prompt_logprobs))
            return
        tracked.outputs.put_nowait(Output(first.token, logprobs=first.logprobs, prompt_logprobs=first.prompt_logprobs))
        if self.decode_ended:
            self.fail(tracked, StageFailure(SERVER_FAULT, self.decode_ended))
            return
        new, seq = tracked.request.new, self.scheduler.get(first.req_id)
        tracked.in_decode = True
        replies = self.stages.decode_admit(DecodeAdmit(
            new.req_id, tuple(seq.block_table), len(new.input_ids), first.token, first.mrope_delta, 1,
            new.max_tokens, new.sampling,
            tuple(sorted(set(new.input_ids))) if new.sampling.repetition_penalty != 1 else ()))
        self._background.spawn(self._admitted(tracked, replies))
        self._grow([first.req_id])

    async def _admitted(self, tracked: Tracked, replies: AsyncIterator) -> None:
        try:
            async for _ in replies:
                pass
        except StageError as exc:  # decode has gone: it holds nothing
            tracked.decode_done = True
            self.fail(tracked, exc.failure)

    async def _follow_decode(self, attached: asyncio.Event) -> None:
        try:
            async for step in self.stages.decode_attach():
                attached.set()
                if step is not None:
                    self._decode_step(step)
            if self.stopping or self.server_stopping():  # the decode stage ends its stream when the server stops
                self.decode_ended = SHUTTING_DOWN
            else:  # or when its loop thread has died: the replica is gone, its clients must not hear "shutting down"
                log.error("orchestrator: the decode stream of replica %d ended while the server runs", self.index)
                self.decode_ended = "decode: its step stream ended unexpectedly (the decode loop stopped)"
        except Exception as exc:  # StageError; anything else must not leave the replica looking alive
            if not isinstance(exc, StageError):
                log.exception("orchestrator: the decode stream of replica %d failed", self.index)
            self.decode_ended = SHUTTING_DOWN if self.stopping else str(exc) or type(exc).__name__
        finally:
            attached.set()  # start() must not wait for a stream that has ended
        for tracked in list(self.requests.values()):  # no more tokens will come
            if tracked.decoding:
                tracked.decode_done = True
                self.fail(tracked, StageFailure(SERVER_FAULT, self.decode_ended))

    def _decode_step(self, step: DecodeStep) -> None:
        now = time.monotonic()
        if self.policy is not None and step.seq_ids and self._last_decode:
            self.policy.observe_decode_gap((now - self._last_decode) * 1e3)
        self._last_decode = now if step.seq_ids else 0.0
        figures, going, ended = step.logprobs or (None,) * len(step.seq_ids), [], []
        rows = sorted(zip(step.seq_ids, step.token_ids, step.finish_reasons, figures), key=lambda row: bool(row[2]))
        for seq_id, token, reason, logprobs in rows:  # the ends last: the streams going on get their tokens first
            tracked = self.live(seq_id)
            if tracked is None:
                continue
            if reason == "error":
                tracked.decode_done = True
                self.fail(tracked, StageFailure(SERVER_FAULT, "decode: the decode step failed"))
                continue
            tracked.last_token = now
            tracked.request.timeline.decoded(step.launched_s, step.read_s, now)
            if reason:
                tracked.decode_done = True
                if tracked.end(Output.last(token, reason, logprobs)):
                    ended.append(tracked)
            else:
                tracked.outputs.put_nowait(Output(token, logprobs=logprobs))
                going.append(seq_id)
        self._grow(going)
        for tracked in ended:  # after the streams' wake-ups: every last token goes out before the releases' upkeep
            self._background.spawn(self._release(tracked))

    def _grow(self, decoded: Iterable[str] = ()) -> None:
        """Send decode the KV pages granted since the last call (``Scheduler.grow``: ``decoded`` made one more token
        each), in order with the admits and aborts sent to it."""
        short = self.scheduler.waiting_for_page
        if grants := self.scheduler.grow(decoded):
            grow = DecodeGrow(tuple((req_id, tuple(pages)) for req_id, pages in grants.items()))
            self._background.spawn(drain(self.stages.decode_grow(grow), "decode's KV pages"))
        if (waiting := self.scheduler.waiting_for_page != short) or grants:  # the gauges (only grants: soon)
            self.on_change(grew=not waiting)

