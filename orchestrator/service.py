"""The orchestrator: one asyncio loop that validates requests, owns the page tables, runs the budget
scheduler step by step and drives the stages (BLS to encode_prefill, the stage link to decode and flashcodec;
design.md, "Processes and data flow").

Per request: probe media (metadata only) -> prompt with its visual-token count -> flashcodec decodes
and streams "group g ready in pages [...]", taking each group's patch pages from the shared free list
only once the group is decoded -> the scheduler's steps encode groups (returning their pages) and
prefill chunks -> first token -> the decode stage takes over -> tokens fan out from the one decode
stream. Every page returns when the request finishes, fails or is cancelled (invariant 2).

When the server stops (backends/triton/server_stop.py), ``stop_serving`` fails every request ("the server is
shutting down"; Triton calls ``finalize`` only once every client stream has its final flag) and reports
when the stages' streams have ended too (each stage ends its own); ``close`` (in ``finalize``) cancels
the loops.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from backends.ipc import shared_pages, shared_tensor
from backends.triton import server_stop
from backends.triton.replicas import replica_name
from backends.runtime.language_model.kv_cache import RESERVED_KV_PAGES
from backends.runtime.sampling.stopping import finish_reason
from backends.runtime.tokenizer import eos_token_ids, load_tokenizer
from backends.stages.flashcodec_worker import plan_to_json
from backends.triton.triton_io import int_parameter
from orchestrator import stages
from orchestrator.detokenizer import Detokenizer
from orchestrator.inputs import InputLimits, ParsedRequest
from orchestrator.media import plan_media
from orchestrator.pages import PageAllocator
from orchestrator.prompt import Prompt, build_prompt
from orchestrator.replica import Replica, choose
from orchestrator.sampling_params import InvalidInput
from orchestrator.scheduler import Scheduler, SchedulerConfig
from orchestrator.sequence import Group, Sequence
from orchestrator.step_plan import StepPlan

log = logging.getLogger(__name__)
CANCEL_POLL_S = 0.05
SHUTTING_DOWN = "the server is shutting down"


@dataclass(frozen=True)
class OrchestratorConfig:
    """From the orchestrator's model parameters. ``max_share`` (default 0.5): while several requests want a
    step's encode or prefill budget, each first gets at most this share of it (``SchedulerConfig``), so a long
    video's prefill cannot hold a short request back; a lone request still uses the whole budget.
    ``max_model_len``: prompt + output tokens per request;
    ``replicas``: encode_prefill/decode replicas to drive (``backends/triton/replicas.py``)."""

    scheduler: SchedulerConfig
    limits: InputLimits
    max_model_len: int
    model_path: str | None
    replicas: int = 1

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> "OrchestratorConfig":
        try:
            share = float(params.get("max_share", "0.5"))
        except ValueError:
            raise ValueError(f"parameter max_share must be a number in (0, 1], got {params['max_share']!r}") from None
        scheduler = SchedulerConfig(encode_budget=int_parameter(params, "encode_budget", 10240),
                                    prefill_budget=int_parameter(params, "prefill_budget", 2048), max_share=share)
        return cls(scheduler, InputLimits.from_parameters(params), int_parameter(params, "max_model_len", 32768),
                   params.get("model_path") or None, int_parameter(params, "replicas", 1))


@dataclass
class Event:
    """What reaches a request's handler: ``kind`` in token | error."""

    kind: str
    token: int = -1
    reason: str = ""
    message: str = ""
    invalid_input: bool = False


def _next_queued(events: asyncio.Queue) -> Event | None:
    """The next event already in ``events``, or None (nothing waits)."""
    try:
        return events.get_nowait()
    except asyncio.QueueEmpty:
        return None


@dataclass
class Active:
    """One request in flight, as the orchestrator tracks it."""

    req_id: str
    parsed: ParsedRequest
    prompt: Prompt
    replica: Replica
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    media_tasks: list[asyncio.Task] = field(default_factory=list)
    groups_reported: dict[int, int] = field(default_factory=dict)  # per media item
    patch_pages_held: int = 0  # reported by flashcodec and not yet encoded (pages)
    patch_pages_peak: int = 0  # the most it held at once (pages)
    in_decode: bool = False
    decode_done: bool = False
    num_generated: int = 0
    mrope_delta: int = 0


class Orchestrator:
    def __init__(self, config: OrchestratorConfig, metrics):
        self.config = config
        self.metrics = metrics
        self.tokenizer = load_tokenizer(config.model_path)
        self.eos_ids = eos_token_ids(self.tokenizer)
        self.active: dict[str, Active] = {}
        self.replicas: list[Replica] = []
        self._ready: asyncio.Future | None = None
        self._tasks: list[asyncio.Task] = []
        self.stopping = False  # the server is stopping: no new work, no aborts to the stages

    # ---- start-up: BLS is not allowed in initialize, so the pools and loops start on first use ----
    async def _start(self) -> None:
        patch = await asyncio.to_thread(shared_tensor.describe, "patch_pool")  # [pages, page, 1176]
        self.patch_page_size = patch["shape"][1]
        # Patch pages are taken by flashcodec as groups are decoded; this process returns them.
        self.patch_pages = await asyncio.to_thread(shared_pages.SharedPageList.attach,
                                                   shared_pages.path_for("patch_pool"))
        assert self.patch_pages.num_total == patch["shape"][0], "patch pool and its free list disagree"
        for index in range(self.config.replicas):
            pool = replica_name("kv_pool", index)
            try:
                kv = await asyncio.to_thread(shared_tensor.describe, pool)  # [layers, 2, pages, page, h, d]
            except TimeoutError as exc:
                raise stages.StageError(f"replicas={self.config.replicas} but replica {index}'s KV pool {pool} "
                                        "is not there: serve with the launcher, which writes the replicas' models "
                                        f"({exc})") from exc
            config = SchedulerConfig(self.config.scheduler.encode_budget, self.config.scheduler.prefill_budget,
                                     self.config.scheduler.max_share, kv["shape"][3])
            # The pool's last page is the runtime's scratch page (CUDA-graph padding rows write there).
            kv_pages = PageAllocator(kv["shape"][2] - RESERVED_KV_PAGES, "kv")
            self.replicas.append(Replica(index, kv_pages, Scheduler(config, kv_pages, self.patch_pages),
                                         kv["shape"][3]))
        loop = asyncio.get_running_loop()
        attached = [asyncio.Event() for _ in self.replicas]
        for replica, event in zip(self.replicas, attached):
            self._tasks += [loop.create_task(self._follow_decode(replica, event)),
                            loop.create_task(self._step_loop(replica))]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in attached)), timeout=60)
        for replica in self.replicas:
            if replica.decode_ended:
                raise stages.StageError(replica.decode_ended)
        self._update_gauges()

    async def ensure_started(self) -> None:
        if self._ready is None:
            self._ready = asyncio.get_running_loop().create_task(self._start())
        await asyncio.shield(self._ready)

    async def _follow_decode(self, replica: Replica, attached: asyncio.Event) -> None:
        try:
            await stages.decode_stream(self._on_decode_step, attached, replica.decode)
            replica.decode_ended = SHUTTING_DOWN  # the decode stage ends its stream only when the server stops
        except Exception as exc:  # StageError; anything else must not leave the replica looking alive
            if not isinstance(exc, stages.StageError):
                log.exception("orchestrator: the decode stream of %s failed", replica.decode)
            replica.decode_ended = SHUTTING_DOWN if self.stopping else str(exc) or type(exc).__name__
        finally:
            attached.set()  # _start must not wait for a stream that has ended
        for active in self.active.values():  # no more tokens will come
            if active.replica is replica and active.in_decode and not active.decode_done:
                active.decode_done = True
                active.events.put_nowait(Event("error", message=replica.decode_ended))

    # ---- stopping (the server's stop watch, then finalize) -------------------------------------------
    def stop_serving(self, on_drained: Callable[[], None]) -> None:
        """The server is stopping: fail every request now (its client gets an error and the final flag)
        and start nothing new. The stages end their own work, so no abort is sent. ``on_drained()``
        once no request, scheduler step or stage stream is left (backends/triton/server_stop.py)."""
        self.stopping = True
        for active in self.active.values():
            active.events.put_nowait(Event("error", message=SHUTTING_DOWN))
        for replica in self.replicas:
            replica.wake.set()
        asyncio.get_running_loop().create_task(self._drain(on_drained))

    async def _drain(self, on_drained: Callable[[], None]) -> None:
        while self.active or not all(t.done() for t in self._tasks) or stages.LINKS.busy():
            await asyncio.sleep(0.02)
        on_drained()

    async def close(self, timeout_s: float = 10.0) -> None:
        """For ``finalize``: cancel the loops and media tasks, wait for the BLS calls made on threads, close
        the stage links."""
        self.stopping = True
        tasks = [*self._tasks, *(t for a in self.active.values() for t in a.media_tasks)]
        if self._ready is not None:
            tasks.append(self._ready)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:  # asyncio.to_thread calls (encode_prefill steps, probes)
            await asyncio.wait_for(asyncio.get_running_loop().shutdown_default_executor(), timeout_s)
        except asyncio.TimeoutError:
            log.warning("orchestrator: stage calls still running at finalize")
        stages.LINKS.close()

    def _update_gauges(self) -> None:
        m = self.metrics
        m.set("unifiedserve_kv_pages_free", sum(r.kv_pages.num_free for r in self.replicas))
        m.set("unifiedserve_kv_pages_total", sum(r.kv_pages.num_total for r in self.replicas))
        m.set("unifiedserve_patch_pages_free", self.patch_pages.num_free)
        m.set("unifiedserve_patch_pages_total", self.patch_pages.num_total)
        m.set("unifiedserve_requests_running", len(self.active))
        m.set("unifiedserve_requests_waiting", sum(r.scheduler.stats().num_waiting for r in self.replicas))
        for r in self.replicas:
            m.set("unifiedserve_replica_kv_pages_free", r.kv_pages.num_free, r.index)
            m.set("unifiedserve_replica_kv_pages_total", r.kv_pages.num_total, r.index)
            m.set("unifiedserve_replica_requests", r.requests, r.index)

    # ---- admission -------------------------------------------------------------------------------
    async def admit(self, parsed: ParsedRequest) -> Active:
        """Plan media, build the prompt, check limits, start media decoding. No patch page is reserved:
        flashcodec takes each group's pages once it is decoded, so a media item needs only its largest
        group to fit in the pool.

        Raises InvalidInput naming the problem (media, prompt length, pool size).
        """
        if self.stopping:
            raise stages.StageError(SHUTTING_DOWN)
        await self.ensure_started()
        plans = [await asyncio.to_thread(plan_media, item, parsed.params) for item in parsed.media]
        prompt = await asyncio.to_thread(build_prompt, self.tokenizer, parsed.text,
                                         [(m.kind, p.grid_thw, getattr(p, "second_per_grid_t", 0.0))
                                          for m, p in zip(parsed.media, plans)])
        prompt.check_length(parsed.params.max_tokens, self.config.max_model_len)
        total = len(prompt.input_ids) + parsed.params.max_tokens
        kv_needed = max(math.ceil(total / r.kv_page_size) for r in self.replicas)
        largest = max(r.kv_pages.num_total for r in self.replicas)
        if kv_needed > largest:
            raise InvalidInput(
                f"the prompt ({len(prompt.input_ids)} tokens, text and visual) plus max_tokens "
                f"({parsed.params.max_tokens}) need {kv_needed} KV pages, the largest KV pool has {largest}: "
                "lower max_tokens or send a shorter prompt or smaller media")
        for item, m in enumerate(prompt.media):
            # One group is never split, so it must fit in the pool at once (then waiting for pages cannot deadlock).
            need = math.ceil(m.patches_per_group / self.patch_page_size)
            if need > self.patch_pages.num_total:
                raise InvalidInput(
                    f"{m.kind} {item}: one temporal-patch group has {m.patches_per_group} patches, which need "
                    f"{need} patch pages of {self.patch_page_size}; the patch pool has {self.patch_pages.num_total} "
                    "pages (lower max_pixels)")
        if self.stopping:  # stop_serving ran while this request was being planned
            raise stages.StageError(SHUTTING_DOWN)
        replica = choose(self.replicas, kv_needed)
        if replica is None:  # every replica whose pool could hold it has lost its decode stream
            raise stages.StageError(next(r.decode_ended for r in self.replicas if r.decode_ended))
        req_id = uuid.uuid4().hex
        active = Active(req_id, parsed, prompt, replica)
        replica.requests += 1
        groups = [Group(item, g, layout.token_offset + g * layout.tokens_per_group, layout.tokens_per_group,
                        layout.patches_per_group)
                  for item, layout in enumerate(prompt.media) for g in range(layout.num_groups)]
        self.active[req_id] = active
        replica.scheduler.add(Sequence(req_id, len(prompt.input_ids), parsed.params.max_tokens, groups))
        loop = asyncio.get_running_loop()
        for item, (media, plan) in enumerate(zip(parsed.media, plans)):
            active.media_tasks.append(loop.create_task(self._run_media(active, item, media, plan)))
        self._update_gauges()
        replica.wake.set()
        return active

    async def _run_media(self, active: Active, item: int, media, plan) -> None:
        layout = active.prompt.media[item]
        active.groups_reported[item] = 0
        bad: list[str] = []

        def on_group(index: int, pages: list[int]) -> None:
            # The pages are ours from here on: never raise, or the pages of later groups would be lost.
            try:
                fresh = active.replica.scheduler.group_ready(active.req_id, item, index, pages)
            except (KeyError, ValueError) as exc:
                self.patch_pages.free(pages)
                bad.append(str(exc))
                return
            if fresh:
                active.groups_reported[item] += 1
                active.patch_pages_held += len(pages)
                active.patch_pages_peak = max(active.patch_pages_peak, active.patch_pages_held)
                active.replica.wake.set()

        body = {"media_plan": plan_to_json(plan), "path": media.path}
        try:
            await stages.flashcodec_decode(active.req_id, media.data, body, on_group)
            if bad:
                raise stages.StageError(f"flashcodec: {bad[0]}")
            if active.groups_reported[item] < layout.num_groups and self.active.get(active.req_id) is active:
                if self.stopping or server_stop.announced():  # flashcodec ends its streams when the server stops
                    raise stages.StageError(SHUTTING_DOWN)
                raise stages.StageError(f"{media.kind}: decoding ended before all sampled frames were found",
                                        invalid_input=True)
        except stages.StageError as exc:
            active.events.put_nowait(Event("error", message=str(exc), invalid_input=exc.invalid_input))
        except Exception as exc:  # a bug here must fail this request, not leave it waiting forever
            log.exception("media task failed for %s", active.req_id)
            active.events.put_nowait(Event("error", message=f"internal error: {type(exc).__name__}: {exc}"))

    # ---- the scheduler loop ----------------------------------------------------------------------
    async def _step_loop(self, replica: Replica) -> None:
        scheduler = replica.scheduler
        while not self.stopping:
            plan = scheduler.schedule()
            if plan is None:
                replica.wake.clear()
                await replica.wake.wait()
                continue
            try:
                result = await stages.encode_prefill(self._plan_json(replica, plan), replica.encode_prefill)
            except Exception as exc:  # the step failed: fail its requests, keep the loop (and the server) alive
                if not isinstance(exc, stages.StageError):
                    log.exception("scheduler step failed")
                for req_id in {w.req_id for w in (*plan.encode, *plan.prefill)}:
                    if req_id in self.active:
                        self.active[req_id].events.put_nowait(Event("error", message=str(exc)))
                    scheduler.remove(req_id)
                scheduler.complete(plan)
                continue
            scheduler.complete(plan)
            self.metrics.increment("unifiedserve_scheduler_steps")
            for w in plan.encode:  # the scheduler returned these groups' patch pages
                if w.req_id in self.active:
                    self.active[w.req_id].patch_pages_held -= len(w.patch_pages)
            self._update_gauges()
            for first in result["first_tokens"]:
                active = self.active.get(first["req"])
                if active is not None:
                    active.events.put_nowait(Event("token", token=first["token"]))
                    active.mrope_delta = first["mrope_delta"]

    def _plan_json(self, replica: Replica, plan: StepPlan) -> dict:
        new = []
        for req_id in dict.fromkeys(w.req_id for w in (*plan.encode, *plan.prefill)):
            if req_id not in replica.registered and req_id in self.active:
                replica.registered.add(req_id)
                a = self.active[req_id]
                new.append({"req": req_id, "input_ids": list(a.prompt.input_ids), "sampling": _sampling(a.parsed),
                            "media": [{"kind": m.kind, "grid_thw": list(m.grid_thw),
                                       "second_per_grid_t": m.second_per_grid_t} for m in a.prompt.media]})
        encode = []
        for w in plan.encode:
            layout = self.active[w.req_id].prompt.media[w.item] if w.req_id in self.active else None
            if layout is None:
                continue
            encode.append({"req": w.req_id, "pages": list(w.patch_pages), "num_patches": w.num_patches,
                           "grid_thw": [1, layout.grid_thw[1], layout.grid_thw[2]],
                           "token_offset": layout.token_offset + w.index * layout.tokens_per_group})
        prefill = [{"req": w.req_id, "start": w.start, "end": w.end, "block_table": list(w.block_table),
                    "is_last": w.is_last} for w in plan.prefill if w.req_id in self.active]
        released, replica.released = replica.released, []
        return {"new": new, "encode": encode, "prefill": prefill, "release": released}

    def _on_decode_step(self, seq_ids: list[str], tokens: list[int], reasons: list[str]) -> None:
        for seq_id, token, reason in zip(seq_ids, tokens, reasons):
            active = self.active.get(seq_id)
            if active is None:
                continue
            if reason == "error":
                active.decode_done = True
                active.events.put_nowait(Event("error", message="decode: the decode step failed"))
            else:
                active.decode_done = bool(reason)
                active.events.put_nowait(Event("token", token=token, reason=reason))

    # ---- per request -----------------------------------------------------------------------------
    async def generate(self, active: Active, is_cancelled):
        """Yield (text_delta, token_ids, finish_reason or None) as tokens arrive; the last item has a
        finish_reason. ``is_cancelled()`` is polled; a cancelled request ends with reason "abort". An item holds
        every token that has arrived by then: one normally, several when this request's handler has fallen
        behind the decode stage (one response for them, not one each: what vLLM's output collector does).

        Raises InvalidInput / StageError when a stage fails on this request (after yielding the tokens that
        came before the failure).
        """
        params = active.parsed.params
        detok = Detokenizer(self.tokenizer, params.stop, params.min_tokens)
        try:
            checked, event = time.monotonic(), None
            while True:
                if event is None:
                    try:
                        event = await asyncio.wait_for(active.events.get(), CANCEL_POLL_S)
                    except asyncio.TimeoutError:
                        pass
                # Poll by time, not only when idle: tokens can arrive faster than the poll period.
                if time.monotonic() - checked >= CANCEL_POLL_S:
                    checked = time.monotonic()
                    if is_cancelled():
                        yield "", [], "abort"
                        return
                if event is None:
                    continue
                deltas, ids = [], []
                while event is not None and event.kind == "token":  # this token and those queued behind it
                    active.num_generated += 1
                    reason = event.reason or finish_reason(event.token, active.num_generated, params.max_tokens,
                                                           params.min_tokens, params.ignore_eos, self.eos_ids)
                    deltas.append(detok.add([event.token]))
                    ids.append(event.token)
                    if detok.stopped:
                        reason = "stop"
                    if reason:
                        yield "".join(deltas) + detok.flush(), ids, reason
                        return
                    if not active.in_decode:
                        await self._admit_to_decode(active, event.token)
                    event = _next_queued(active.events)
                if ids:
                    yield "".join(deltas), ids, None
                if event is not None:  # an error, after the tokens before it
                    if event.invalid_input:
                        raise InvalidInput(event.message)
                    raise stages.StageError(event.message)
        finally:
            await self.release(active)

    async def _admit_to_decode(self, active: Active, first_token: int) -> None:
        replica = active.replica
        payload = {"seq_id": active.req_id, "block_table": replica.scheduler.get(active.req_id).block_table,
                   "num_cached": len(active.prompt.input_ids),
                   "last_token": first_token, "mrope_delta": active.mrope_delta, "num_generated": 1,
                   "max_tokens": active.parsed.params.max_tokens, "sampling": _sampling(active.parsed)}
        if replica.decode_ended:
            raise stages.StageError(replica.decode_ended)
        active.in_decode = True
        await stages.decode_admit(payload, replica.decode)

    async def release(self, active: Active) -> None:
        """Stop every stage's work on the request, then return all its pages. Idempotent."""
        if self.active.get(active.req_id) is not active:
            return
        replica = active.replica
        if not self.stopping:  # stopping: the stages end their work themselves, and no page is reused
            if active.in_decode and not active.decode_done:  # KV pages are reused once decode drops them
                await self._abort(stages.decode_abort(active.req_id, replica.decode))
            if any(not t.done() for t in active.media_tasks):
                await self._abort(stages.flashcodec_abort(active.req_id))
                await asyncio.gather(*active.media_tasks, return_exceptions=True)  # patch pages no longer written
        del self.active[active.req_id]
        replica.requests -= 1
        replica.scheduler.remove(active.req_id)  # returns the patch pages of groups decoded but not yet encoded
        if active.prompt.media:
            self.metrics.set("unifiedserve_patch_pages_peak_last_request", active.patch_pages_peak)
        if active.req_id in replica.registered:
            replica.registered.discard(active.req_id)
            replica.released.append(active.req_id)
        self._update_gauges()
        replica.wake.set()

    @staticmethod
    async def _abort(call) -> None:
        """An abort call to a stage; one whose link is gone (the stage's process ended) writes no page any
        more, so the request's pages may be returned all the same (logged)."""
        try:
            await call
        except stages.StageError as exc:
            log.warning("orchestrator: abort not delivered (%s); the stage has gone, its pages are returned", exc)


def _sampling(parsed: ParsedRequest) -> dict:
    """The fields of backends.runtime.sampling.sampler.SamplingParams, as the stages rebuild it."""
    p = parsed.params
    return {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "seed": p.seed,
            "min_tokens": p.min_tokens, "ignore_eos": p.ignore_eos}
