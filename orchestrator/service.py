"""The orchestrator's service: finds the shared pools, runs one engine per replica (``orchestrator.engine``), admits
requests (media plans, the prompt, the limits), routes each to an engine, keeps the gauges, drains at the stop.

Per request: probe media (metadata only) -> prompt with its visual-token count -> the engine runs it (media decoding,
encode and prefill steps under the token budgets, decode) -> ``stream`` turns its tokens into the client's text
(``orchestrator.output_processor``). The stages are reached over the stage link only (``orchestrator.stage_clients``).

When the server stops (``backends.triton.server_stop``), ``stop_serving`` fails every request ("the server is
shutting down"; Triton calls ``finalize`` only once every client stream has its final flag) and reports when
the stages' streams have ended too (each stage ends its own); ``close`` (in ``finalize``) cancels the loops.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable

from backends.ipc import shared_pages
from backends.ipc.link import StageError
from backends.ipc.protocol import RESERVED_KV_PAGES, SERVER_FAULT, MediaDecode, MediaGrid, NewRequest, StageFailure
from backends.triton import server_stop
from backends.triton.replicas import replica_name
from orchestrator.budget_policy import BudgetPolicy
from orchestrator.burst import Arrivals
from orchestrator.config import OrchestratorConfig
from orchestrator.decode_pace import DecodePacer
from orchestrator.engine import Engine
from orchestrator.engine_io import EngineRequest, Released, RequestCounts, shutting_down
from orchestrator.fewer_sms import FewerSms
from orchestrator.gauges import Gauges, num_waiting
from orchestrator.choice_reservations import ChoiceReservations
from orchestrator.off_loop import admission_runner
from orchestrator.inputs import ParsedRequest
from orchestrator.media import media_report, plan_request, probe_media, with_media_defaults
from orchestrator.media_identity import media_identity
from orchestrator.metrics import observe_engine_times
from orchestrator.output_processor import OutputProcessor
from orchestrator.pages import PageAllocator
from orchestrator.encoder_cache import EncoderCache, group_key
from orchestrator.prefix_cache import block_hashes
from orchestrator.prompt import Prompt, build_chat_prompt, build_raw_prompt, build_token_prompt, token_prompt_text
from orchestrator.reply_limit import reply_limit
from orchestrator.routing import choose
from orchestrator.sampling_params import InvalidInput
from orchestrator.scheduler import Scheduler, SchedulerConfig
from orchestrator.sequence import Group
from orchestrator.shown import shown
from orchestrator.stage_clients import LinkMedia, Links, LinkStages, published
from orchestrator.served_template import with_template
from orchestrator.timeline import NO_TIMELINE, Timeline
from orchestrator.token_strings import TokenStrings
from orchestrator.visual_cap import CapApplied

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Admitted:
    """A request running in ``engine``: its id, prompt and output queue."""

    req_id: str
    parsed: ParsedRequest
    prompt: Prompt
    engine: Engine
    outputs: asyncio.Queue
    visual_cap: CapApplied | None = None  # what max_visual_tokens changed in its media
    counts: RequestCounts = field(default_factory=RequestCounts)  # its prompt tokens found cached, once known
    media: list[dict] | None = None  # what was done with each media item (orchestrator.media.media_report)
    prompt_text: str | None = None  # a prompt_token_ids request's prompt as text (its first response's prompt_text)


@dataclass(frozen=True)
class Tokenized:
    """A ``tokenize_only`` request's prompt (:meth:`Orchestrator.tokenize`): ``token_strings``, each id's token
    (``convert_ids_to_tokens``) as UTF-8 bytes (``orchestrator.token_strings``), and what ``Admitted`` would hold of
    its media and text."""

    prompt: Prompt
    token_strings: list[bytes]
    visual_cap: CapApplied | None
    media: list[dict] | None
    prompt_text: str | None


OVERLOADED = "the server is overloaded"


class Overloaded(RuntimeError):
    """A request refused for the server's load, not its content (Triton's UNAVAILABLE; HTTP 503): retry later."""


class Orchestrator:
    def __init__(self, config: OrchestratorConfig, metrics):
        # transformers' tokenizer, the runtime families, xgrammar (structured outputs): loaded here, not on first use
        from backends.runtime.families.registry import model_tokenizer, sampled_ids
        from backends.runtime.sampling import grammar  # noqa: F401

        self.config, self.metrics, self.content = config, metrics, config.content_format
        self.family = config.model.family  # its media rules and prompt text
        self.tokenizer = with_template(model_tokenizer(config.model), config.chat_template, self.family, self.content)
        self.sampled_ids = sampled_ids(config.model, self.tokenizer)  # stop_token_ids' bound
        self.outputs, self.token_strings = OutputProcessor(self.tokenizer), TokenStrings(self.tokenizer)
        self.links = Links()
        self.engines: list[Engine] = []
        self._ready: asyncio.Future | None = None
        self.stopping, self.stop_why = False, ""  # the server is stopping (why, if said): no new work, no aborts
        self.gauges = Gauges(metrics, lambda: (self.engines, self.patch_pages))
        self.reservations = ChoiceReservations()  # places held for requests' later choices (n > 1)
        self.arrivals = Arrivals()  # requests Triton handed over (its execute thread: note_arrivals), admitted since

    # ---- start-up: the stages may still be loading, so the pools and engines start on first use ----------
    async def _start(self) -> None:
        patch = await published("patch_pool", "the flashcodec model is not loaded (it publishes the patch pool)")
        self.patch_page_size = patch["shape"][1]
        # Patch pages are taken by flashcodec as groups are decoded; this process returns them.
        self.patch_pages = await asyncio.to_thread(shared_pages.SharedPageList.attach,
                                                   shared_pages.path_for("patch_pool"))
        assert self.patch_pages.num_total == patch["shape"][0], "patch pool and its free list disagree"
        media = LinkMedia(self.links)
        engines: list[Engine] = []  # kept once all have started: a failed start is tried again by the next request
        try:
            await self._start_engines(media, engines)
        except BaseException:
            await asyncio.gather(*(engine.close() for engine in engines), return_exceptions=True)
            raise
        self.engines = engines
        self.gauges.update()

    async def _start_engines(self, media: LinkMedia, engines: list) -> None:
        """One engine per replica, appended to ``engines`` as made, started, and every stage link connected."""
        for index in range(self.config.replicas):
            pool = replica_name("kv_pool", index)
            missing = (f"the {replica_name('decode', index)} model is not loaded (it publishes {pool})" if not index
                       else f"replicas={self.config.replicas} but replica {index}'s KV pool {pool} is not there: "
                            "serve with the launcher, which writes the replicas' models")
            kv = await published(pool, missing)  # [layers, 2, pages, page, h, d]
            config = replace(self.config.scheduler, kv_page_size=kv["shape"][3])
            kv_pages = self.config.cache.pool(PageAllocator(kv["shape"][2] - RESERVED_KV_PAGES, "kv"))
            slo, boost = self.config.slo, self.config.policy.decode_priority_boost
            policy = (BudgetPolicy(config.encode_budget, config.prefill_budget, slo, self.config.policy)
                      if self.config.slo_scheduling else None)
            pace_ms = self.config.decode_pace_ms
            pacer = DecodePacer(pace_ms, config.prefill_budget, slo, boost) if pace_ms else None
            engines.append(Engine(
                index, Scheduler(config, kv_pages, self.patch_pages, EncoderCache(self.config.cache.encoder_tokens)),
                self.patch_pages, LinkStages(self.links, index), media, on_change=self.gauges.changed,
                on_step=self._on_step, on_release=self._on_release, stopping=server_stop.announced, policy=policy,
                arrivals=self.arrivals, pacer=pacer,
                fewer_sms=FewerSms(slo, boost, self.config.fewer_sms_kinds), joins=self.config.joins))
        await asyncio.gather(*(engine.start() for engine in engines))
        # every link connected before the first request: from then on a call is queued when it is made, so an abort
        # never overtakes the call it stops (decode's is connected by its stream)
        await asyncio.gather(*(self.links[name].connect() for name in
                               ("flashcodec", *(replica_name("encode_prefill", i) for i in range(len(engines))))))

    async def ensure_started(self) -> None:
        """Start the pools and engines on first use; the requests arriving meanwhile wait for that one start. A
        start that failed (a stage still loading, a pool not published) raises its error to the requests that
        waited for it, and the next request tries again."""
        failed = self._ready is not None and self._ready.done() and (self._ready.cancelled()
                                                                      or self._ready.exception() is not None)
        if self._ready is None or failed:
            self._ready = asyncio.get_running_loop().create_task(self._start())
        await asyncio.shield(self._ready)

    # ---- stopping (the server's stop watch, then finalize) -------------------------------------------------
    def stop_serving(self, on_drained: Callable[[], None], why: str = "") -> None:
        """The server is stopping: fail every request now (its client gets an error and the final flag), refuse new
        ones (saying ``why``); ``on_drained()`` once no request, engine loop or stage call is left."""
        self.stopping, self.stop_why = True, why
        for engine in self.engines:
            engine.stop()
        asyncio.get_running_loop().create_task(self._drain(on_drained))

    async def _drain(self, on_drained: Callable[[], None]) -> None:
        while any(engine.busy() for engine in self.engines) or self.links.busy():
            await asyncio.sleep(0.02)
        on_drained()

    async def close(self, timeout_s: float = 10.0) -> None:
        """For ``finalize``: cancel the engines' loops and calls, wait for the work on threads (probes, prompts),
        close the stage links."""
        self.stopping = True
        if self._ready is not None:
            self._ready.cancel()
        await asyncio.gather(*(engine.close() for engine in self.engines), return_exceptions=True)
        try:
            await asyncio.wait_for(asyncio.get_running_loop().shutdown_default_executor(), timeout_s)
        except asyncio.TimeoutError:
            log.warning("orchestrator: work on threads still running at finalize")
        self.links.close()

    def _on_step(self, paced: bool) -> None:
        self.metrics.increment("unifiedserve_scheduler_steps_total")
        if paced:
            self.metrics.increment("unifiedserve_decode_paced_steps_total")

    def _on_release(self, released: Released) -> None:
        if released.had_media:
            self.metrics.set("unifiedserve_patch_pages_peak_last_request", released.patch_pages_peak)
        observe_engine_times(self.metrics, released)

    # ---- admission -----------------------------------------------------------------------------------------
    def note_arrivals(self, n: int) -> None:
        """``n`` requests handed over by Triton (its execute thread; each ends with :meth:`admission_ended`)."""
        self.arrivals.note(n)

    def admission_ended(self) -> None:
        """A request handed over is admitted or refused (on the event loop): a step waiting for the burst's requests
        looks again (``orchestrator.burst``)."""
        self.arrivals.settle()
        for engine in self.engines:
            engine.wake.set()

    async def tokenize(self, parsed: ParsedRequest, token_strings: bool = True) -> Tokenized:
        """The prompt that :meth:`admit` would run for ``parsed`` (its chat template, its media's visual tokens after
        ``max_visual_tokens``), with nothing run: vLLM's ``/tokenize``; with ``prompt_token_ids``, their text (its
        ``/detokenize``, the tokens only the server places, such as ``<|image_pad|>``, taken). Its length is not
        checked against ``max_model_len`` (vLLM's rule for these endpoints). Its ids' token strings only with
        ``token_strings`` (else none).
        Raises InvalidInput as admission's planning does (media, token ids outside the vocabulary)."""
        def planned(parsed: ParsedRequest) -> Tokenized:
            infos, plans, cap, prompt, _, text = self._prompt_of(parsed, reserved_ok=True)
            strings = self.token_strings.of(prompt.input_ids) if token_strings else []
            return Tokenized(prompt, strings, cap, media_report(infos, plans) or None, text)
        return await admission_runner(parsed)(planned, parsed)

    async def admit(self, parsed: ParsedRequest, timeline: Timeline = NO_TIMELINE, choices: int = 1,
                    choice_of: str = "", request_id: str = "") -> Admitted:
        """Plan media, build the prompt, check limits, hand the request to an engine (its media decoding starts).
        No patch page is reserved: flashcodec takes each group's pages once it is decoded, so a media item needs
        only its largest group to fit in the pool. A request's choices are admitted as one
        (``orchestrator.choice_reservations``): with ``choices`` over 1 the request ``request_id`` is admitted only
        where the waiting queue has room for all of them, and places are held for the others; a request naming one
        in ``choice_of`` takes such a place, whatever the load (without one left, it is admitted as any other).

        Raises InvalidInput naming the problem (media, prompt length, pool size; ``choices`` without a request id,
        beside ``choice_of``, over ``max_waiting_requests``, or for a request id holding places already);
        Overloaded when ``max_waiting_requests`` requests already wait for KV pages, or, for several ``choices``,
        too many with the places held for other requests' choices to leave room for all of them; StageError when
        the server is stopping or no replica can serve.
        """
        if self.stopping:
            raise shutting_down(self.stop_why)
        params = parsed.params  # the sampler indexes logits by these ids
        for key, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias's ids", dict(params.logit_bias))):
            if ids and max(ids) >= self.sampled_ids:
                raise InvalidInput(f"sampling_parameters: {key} must be below the vocabulary size "
                                   f"{self.sampled_ids}, got {shown(max(ids))}")
        self._check_choices(choices, choice_of, request_id)
        await self.ensure_started()
        placed = bool(choice_of) and self.reservations.take(choice_of)  # a later choice: a place is held for it
        if not placed:
            self._refuse_when_overloaded(choices)  # at once, before any work on the request
        off_loop = admission_runner(parsed)
        infos, plans, cap, prompt, probed, prompt_text = await off_loop(self._prompt_of, parsed)
        timeline.mark("probed", at=probed, items=len(infos))
        timeline.mark("prompt_built", tokens=len(prompt.input_ids), visual_tokens=prompt.num_visual_tokens)
        pool_tokens = max(e.scheduler.kv_pages_total * e.scheduler.config.kv_page_size for e in self.engines)
        max_tokens = reply_limit(params.max_tokens, params.min_tokens, len(prompt.input_ids),
                                 default_max_tokens=self.config.reply_cap,
                                 max_model_len=self.config.max_model_len, pool_tokens=pool_tokens)
        prompt.check_length(max_tokens, self.config.max_model_len, self.family)
        total = len(prompt.input_ids) + max_tokens
        kv_needed = max(e.scheduler.kv_pages_for(total) for e in self.engines)
        largest = max(e.scheduler.kv_pages_total for e in self.engines)
        if kv_needed > largest:
            sent = params.max_tokens is not None  # else the prompt alone fills the pool (reply_limit)
            raise InvalidInput(
                f"the prompt ({len(prompt.input_ids)} tokens, text and visual) "
                + (f"plus max_tokens ({max_tokens}) need" if sent else "needs")
                + f" {kv_needed} KV pages" + ("" if sent else " with one token of output")
                + f", the largest KV pool has {largest}"
                + (f" once the prefix cache's floor is kept (prefix_cache_floor {self.config.cache.floor})"
                   if self.config.cache.floor else "")
                + (": lower max_tokens or send" if sent else ": send") + " a shorter prompt or smaller media")
        for item, m in enumerate(prompt.media):
            # One group is never split, so it must fit in the pool at once (then waiting for pages cannot deadlock).
            need = -(-m.patches_per_group // self.patch_page_size)
            if need > self.patch_pages.num_total:
                smaller = "lower max_pixels (or min_pixels), or " \
                    if "max_pixels" in self.family.fewer_tokens[m.kind] else ""
                raise InvalidInput(
                    f"{m.kind} (item {item + 1} of {len(prompt.media)}): one media group has {m.patches_per_group} "
                    f"patches, which need {need} patch pages of {self.patch_page_size}; the patch pool has "
                    f"{self.patch_pages.num_total} pages ({smaller}raise flashcodec's patch_pages)")
        if self.stopping:  # stop_serving ran while this request was being planned
            raise shutting_down(self.stop_why)
        if not placed:  # again: requests planned at the same time may have been added meanwhile
            self._refuse_when_overloaded(choices)
        engine = choose(self.engines, len(prompt.input_ids), max_tokens)
        if engine is None:  # every replica whose pool could hold it has lost its decode stream
            raise StageError(StageFailure(SERVER_FAULT, next(e.decode_ended for e in self.engines if e.decode_ended)))
        identities, hashes, cache = (), (), self.config.cache
        if cache.enabled or cache.encoder_tokens:
            identities, hashes = await off_loop(self._identify, parsed, plans, prompt, engine.scheduler.config)
        if choices > 1:
            self.reservations.hold(request_id, choices - 1)
        req_id = uuid.uuid4().hex
        request = EngineRequest(
            NewRequest(req_id, prompt.input_ids,
                       tuple(MediaGrid(m.kind, m.grid_thw, m.second_per_grid_t) for m in prompt.media),
                       params.sampling(), max_tokens),
            tuple(Group(item, g, layout.group_offsets[g], layout.tokens_per_group,
                        layout.patches_per_group,
                        cache_key=group_key(identities[item], g) if cache.encoder_tokens else None)
                  for item, layout in enumerate(prompt.media) for g in range(layout.num_groups)),
            tuple(MediaDecode(req_id, plan, data=media.data or None, path=media.path, stamp=media.stamp)
                  for media, plan in zip(parsed.media, plans)),
            tuple(layout.num_groups for layout in prompt.media), timeline, hashes,
            media_names=tuple(m.input_name for m in parsed.media))
        return Admitted(req_id, parsed, prompt, engine, engine.add(request), cap, request.counts,
                        media_report(infos, plans) or None, prompt_text)

    def _prompt_of(self, parsed: ParsedRequest, reserved_ok: bool = False
                   ) -> tuple[list, list, CapApplied | None, Prompt, float, str | None]:
        """Probe each media item, plan it (the family's rules, ``max_visual_tokens``) and build the prompt, in one
        call, so a media request leaves the event loop once (``admission_runner``): under 16 text streams an image
        request's admission, then three hops, took 77 ms p50 against 22 without them (the ninth run's
        ``timelines.json``, bench/results/peer/ninth-run-2026-12-03/), in one hop 20-25 ms (the tenth run's).
        Returns the probes, plans, the cap applied, the prompt, when the probes ended (``time.monotonic()``) and a
        ``prompt_token_ids`` request's text (``Admitted.prompt_text``; else None); ``reserved_ok``: its ids may hold
        the tokens only the server places (a prompt only decoded: ``build_token_prompt``).
        Raises InvalidInput as ``probe_media``, ``plan_request`` and the prompt do."""
        limits = self.config.limits
        infos = [probe_media(item, limits.max_image_pixels) for item in parsed.media]
        probed = time.monotonic()
        media_params = with_media_defaults(parsed.params, self.config.media_defaults, self.family)
        plans, cap = plan_request(list(parsed.media), infos, media_params, self.family, limits.max_visual_tokens)
        text = None
        if parsed.token_ids is not None:
            prompt = build_token_prompt(self.tokenizer, parsed.token_ids, self.sampled_ids, self.family, reserved_ok)
            text = token_prompt_text(self.tokenizer, list(parsed.token_ids))
        elif parsed.raw:
            prompt = build_raw_prompt(self.tokenizer, parsed.text, self.family)
        else:
            media = [(m.kind, p.grid_thw, getattr(p, "second_per_grid_t", 0.0)) for m, p in zip(parsed.media, plans)]
            prompt = build_chat_prompt(self.tokenizer, parsed.turns, media, self.family, parsed.chat, self.content)
        return infos, plans, cap, prompt, probed, text

    def _identify(self, parsed: ParsedRequest, plans: list, prompt: Prompt, config: SchedulerConfig
                  ) -> tuple[list[bytes], tuple[bytes, ...]]:
        """Each media item's ``media_identity`` (the encoder cache's keys), and the prompt's ``block_hashes`` for
        the prefix cache (empty when it is off).

        Raises:
            InvalidInput: a media file could not be read (it was probed just before).
        """
        identities = [media_identity(item, plan) for item, plan in zip(parsed.media, plans)]
        if not self.config.cache.enabled:
            return identities, ()
        spans = [(m.token_offset, m.token_offset + m.num_tokens, i) for m, i in zip(prompt.media, identities)]
        return identities, block_hashes(prompt.input_ids, spans, config.kv_page_size)

    def _check_choices(self, choices: int, choice_of: str, request_id: str) -> None:
        """Raises InvalidInput for several ``choices`` without a ``request_id`` (their later choices name it), asked
        for by a later choice (``choice_of``: it would hold places of its own past the limit), or more than
        ``max_waiting_requests`` can ever hold."""
        if choices > 1 and not request_id:
            raise InvalidInput("choices: a request whose choices are admitted as one needs a request id (its "
                               "later choices name it in choice_of)")
        if choice_of and choices > 1:
            raise InvalidInput("choices: a later choice (one naming a request in choice_of) holds no places of its "
                               "own: send choices with the first choice only")
        if choices > self.config.max_waiting_requests:
            raise InvalidInput(f"choices: {choices} choices need as many places in the waiting queue, which holds at "
                               f"most {self.config.max_waiting_requests} (parameter max_waiting_requests): ask for "
                               "fewer")

    def _refuse_when_overloaded(self, choices: int = 1) -> None:
        """Raises Overloaded unless the requests waiting for KV pages (all replicas) leave room for ``choices`` more
        under ``max_waiting_requests``; for several choices, the places held for other requests' choices
        (``reservations``) count as waiting too. A single request does not count them: places a client holds and
        never takes refuse no plain request (the queue may then grow past the limit by the places held, at most as
        many again)."""
        held = self.reservations.held() if choices > 1 else 0
        waiting = num_waiting(self.engines) + held
        if waiting + choices > self.config.max_waiting_requests:
            whose = f" ({held} of them places held for other requests' choices)" if held else ""
            need = f": this request's {choices} choices need as many places" if choices > 1 else ""
            raise Overloaded(f"{OVERLOADED}: {waiting} requests wait for KV pages{whose}, of at most "
                             f"{self.config.max_waiting_requests} (parameter max_waiting_requests){need}; retry later")

    def stream(self, admitted: Admitted) -> AsyncIterator[tuple[str, list[int], str | None]]:
        """The request's ``(text_delta, token_ids, finish_reason or None)`` items (``OutputProcessor.stream``)."""
        return self.outputs.stream(admitted.engine, admitted.req_id, admitted.outputs, admitted.parsed.params,
                                   admitted.prompt.input_ids)

    def cancel(self, admitted: Admitted) -> None:
        """End the request's stream with ``"abort"`` after the tokens queued already (the client cancelled); on
        the event loop."""
        self.outputs.cancel(admitted.outputs)
