"""The budget scheduler of docs/design.md, "Scheduling": encode and prefill work for one step, pure Python.

Each step the encode_prefill worker runs the plan's encode (whole temporal-patch groups, at most
`encode_budget` patches) and then its prefill (prompt chunks, at most `prefill_budget` tokens), so a
step is bounded and decode, in its own process, is never starved. One step is in flight at a time:
`schedule()` hands out a plan, `complete()` applies it once the worker has run it. The plan is the whole
of what the stage needs (`backends.ipc.protocol.StepPlan`): the requests it sees for the first time and
those it may forget come with the work. What a step holds: `orchestrator.step_fill` (a normal step, or a short
one of prefills about to end their prompts).
"""

from collections.abc import Iterable
from dataclasses import dataclass, replace

from backends.ipc.protocol import EncodeWork, StepPlan
from orchestrator import step_fill
from orchestrator.encoder_cache import EncoderCache
from orchestrator.kv_grants import KVGrants
from orchestrator.pages import PagePool
from orchestrator.prefix_cache import CacheStats, PrefixCache
from orchestrator.sequence import Group, Sequence


@dataclass(frozen=True)
class SchedulerConfig:
    """Budgets of one step (defaults: the paper's Qwen2.5-VL deployment).

    Attributes:
        encode_budget: vision-encoder input patches per step (before the 2x2 merge). A group larger
            than this runs alone in a step.
        prefill_budget: LLM prompt tokens per step.
        max_share: fairness cap, in (0, 1]. While several sequences want a budget in a step, each
            first gets at most `max_share` of it (for encode, a sequence's first group of the step is
            exempt, as groups are not split); what is left then goes out again in FCFS order without
            the cap, so a lone sequence may still use the whole budget. 1.0 is plain FCFS.
        kv_page_size: tokens per KV page.
        kv_pages_ahead: KV pages a sequence holds past the tokens written (>= 1): at admission its prompt's and
            this many more (at most its prompt + max_tokens), granted again as decode writes them
            (``Scheduler.grow``, ``orchestrator.kv_growth``), so that decode does not wait for a page between steps.
        short_prefill_tokens: a prompt not started (but for its cached prefix) that ends within this many tokens,
            every embedding ready, goes into a short step of such prefills only, ahead of other work
            (``orchestrator.step_fill``); 0: off.
        max_short_steps: short steps in a row while other work waits; then a normal step (no starvation).
        burst_wait_ms: ms a step may wait for the rest of a burst while two prompts or more wait for prefill and
            do not fill ``prefill_budget`` (the engine's, ``orchestrator.burst``); 0: off.
        idle_budget_scale: both budgets are this many times larger in a step planned while decode holds no
            sequence (no stream's TBT to protect: a lone video or a burst of prompts reaches its first tokens in
            fewer, larger steps, as the SLO policy's idle rule does, ``orchestrator.budget_policy``); 1: off.

    Raises:
        ValueError: a budget or page size is not a positive integer, short_prefill_tokens is negative,
            max_short_steps or idle_budget_scale below 1, burst_wait_ms negative, or max_share not in (0, 1].
    """

    encode_budget: int = 10240
    prefill_budget: int = 2048
    max_share: float = 1.0
    kv_page_size: int = 16
    kv_pages_ahead: int = 2
    short_prefill_tokens: int = 0
    max_short_steps: int = 4
    burst_wait_ms: int = 0
    idle_budget_scale: int = 1

    def __post_init__(self) -> None:
        for name, least in (("encode_budget", 1), ("prefill_budget", 1), ("kv_page_size", 1), ("kv_pages_ahead", 1),
                            ("short_prefill_tokens", 0), ("max_short_steps", 1), ("burst_wait_ms", 0),
                            ("idle_budget_scale", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"SchedulerConfig.{name} must be an integer >= {least}, got {value!r}")
        if not 0 < self.max_share <= 1:
            raise ValueError(f"SchedulerConfig.max_share must be in (0, 1], got {self.max_share!r}")

    def step_budgets(self, decode_running: bool) -> tuple[int, int]:
        """(encode patches, prefill tokens) of a step planned with the configured budgets: ``idle_budget_scale``
        times them while decode holds no sequence (``decode_running`` false)."""
        scale = 1 if decode_running else self.idle_budget_scale
        return self.encode_budget * scale, self.prefill_budget * scale


@dataclass(frozen=True)
class SchedulerStats:
    """Gauges: sequences by state (``num_waiting_for_page``: in decode, refused the KV page their next tokens need),
    and free/total pages of both pools (pages)."""

    num_waiting: int
    num_prefilling: int
    num_prefilled: int
    step_in_flight: bool
    kv_pages_free: int
    kv_pages_total: int
    patch_pages_free: int
    patch_pages_total: int
    num_waiting_for_page: int = 0


class Scheduler:
    """Admits sequences in arrival order (with backfill, see `_admit`), grants their KV pages and plans
    encode + prefill steps.

    Pages: a sequence is admitted with the KV pages of its prompt and of its next tokens (``kv_pages_ahead``), and
    granted more as decode writes them (`grow`), where the pool stays safe: every admitted sequence could still be
    granted pages up to its prompt + max_tokens, one after another (``orchestrator.kv_growth``); it keeps them until
    `remove`. The longest cached prefix of the prompt (``orchestrator.prefix_cache``: its full pages, by
    the sequence's `block_hashes`) is shared, not taken, and counts as computed (vLLM's ``num_computed_tokens``
    rule), so the budgets pay only for new work. Once a step has written a full prompt page, the page is cached.
    Patch pages are never reserved here: the media stage takes a group's pages
    from the shared `patch_pages` free list once that group is decoded and hands them over by
    `group_ready`; they return once the group is encoded or its sequence removed. Pages that the step
    in flight uses return when it completes.
    """

    def __init__(self, config: SchedulerConfig, kv_pages: PrefixCache, patch_pages: PagePool,
                 encoder_cache: EncoderCache | None = None) -> None:
        self.config = config
        self._kv = kv_pages
        self._patch = patch_pages
        self.encoder_cache = encoder_cache or EncoderCache(0)  # groups found there are neither decoded nor encoded
        # Arrival order (admission follows it, but for the backfill of `_admit`).
        self._seqs: dict[str, Sequence] = {}
        self._in_flight: StepPlan | None = None
        self._in_flight_seqs: dict[str, Sequence] = {}
        self._deferred: list[tuple[PagePool, list[int]]] = []
        self._announced: set[str] = set()  # sequences whose `request` went out in a plan
        self._held: set[str] = set()  # sequences being removed: planned no more, their pages kept until `remove`
        self._finished: list[str] = []  # announced sequences removed since the last plan
        self._short_streak = 0  # short steps in a row (``SchedulerConfig.max_short_steps``)
        self._pages = KVGrants(kv_pages, config.kv_page_size, config.kv_pages_ahead, self._seqs, self._held)

    def add(self, seq: Sequence) -> None:
        """Queues a new sequence and grants it its KV pages at once when the admission rule lets it (`_admit`; a
        step in flight does not hold admission up), else it waits (its ready groups may be encoded already).

        Groups that already have `patch_pages` are handed over with it.

        Raises:
            ValueError: duplicate req_id, a sequence that is not new, or one needing more KV pages
                than the pool has (it would wait forever, and hold back every later sequence).
        """
        if seq.req_id in self._seqs:
            raise ValueError(f"{seq.req_id}: already scheduled")
        if seq.block_table is not None or seq.num_computed_tokens or any(g.encoded for g in seq.groups):
            raise ValueError(f"{seq.req_id}: not a new sequence")
        need = self.kv_pages_for(seq.prompt_len + seq.max_tokens)
        if need > self._kv.num_total:
            raise ValueError(f"{seq.req_id}: needs {need} KV pages for {seq.prompt_len} + {seq.max_tokens} "
                             f"tokens, the pool has {self._kv.num_total}")
        self._seqs[seq.req_id] = seq
        cached = self.encoder_cache.claim(seq)
        if cached and seq.request is not None:
            seq.request = replace(seq.request, cached_embeds=cached)
        self._admit()

    def group_ready(self, req_id: str, item: int, index: int, pages: list[int]) -> str:
        """The media stage reports group (item, index) of `req_id` ready in patch `pages`.

        The scheduler owns the pages from here on. Returns "taken"; "cached" (the pages freed) when the group's
        tokens were found in the prefix cache or its embeddings in the encoder cache, so it needs no encoding;
        "gone" (the pages freed) when the request is no longer known: it was removed while its media was being
        decoded (so `add` a sequence before its media stage starts).

        Raises:
            KeyError: no such group.
            ValueError: the group was already reported, or `pages` is empty.
        """
        seq = self._seqs.get(req_id)
        if seq is None:
            self._patch.free(pages)
            return "gone"
        group = seq.group(item, index)
        if group.cached:
            self._patch.free(pages)
            return "cached"
        if group.patch_pages is not None or group.encoded or not pages:
            raise ValueError(f"{req_id}: group (item={item}, index={index}) reported twice or without pages")
        group.patch_pages = list(pages)
        return "taken"

    def schedule(self, budgets: tuple[int, int] | None = None, *, decode_running: bool = False) -> StepPlan | None:
        """Admits what fits and plans the next step; None when nothing can run now. ``budgets``: this step's
        (encode patches, prefill tokens), each >= 1, instead of the configured ones (an SLO policy's:
        ``orchestrator.budget_policy``); ``decode_running``: decode holds sequences now (the engine knows; without
        ``budgets`` the configured ones are scaled: ``SchedulerConfig.step_budgets``). The step is a short one
        (``step_fill.short_prefills``) while prefills within ``short_prefill_tokens`` of their prompt's end wait
        beside other work, at most ``max_short_steps`` in a row; else a normal one (``step_fill.fill_encode``,
        ``fill_prefill``).

        Raises:
            RuntimeError: the previous plan has not been completed.
            ValueError: a budget below 1.
        """
        if self._in_flight is not None:
            raise RuntimeError("a step is in flight: complete() it before scheduling the next")
        encode_budget, prefill_budget = budgets or self.config.step_budgets(decode_running)
        if encode_budget < 1 or prefill_budget < 1:
            raise ValueError(f"budgets must be >= 1, got {budgets}")
        self._admit()
        live = [seq for seq in self._seqs.values() if seq.req_id not in self._held]
        short = (step_fill.short_prefills(live, prefill_budget, self.config.short_prefill_tokens)
                 if self._short_streak < self.config.max_short_steps else [])
        if short and step_fill.has_other_work(live, {w.req_id for w in short}):
            encode, prefill = [], short
            self._short_streak += 1
        else:
            encode = [self._encode_work(seq, group)
                      for seq, group in step_fill.fill_encode(live, encode_budget, self.config.max_share)]
            prefill = step_fill.fill_prefill(live, encode, prefill_budget, self.config.max_share)
            self._short_streak = 0
        if not encode and not prefill:
            return None
        planned = dict.fromkeys(w.req_id for w in (*encode, *prefill))
        new = []
        for req_id in planned:
            if req_id not in self._announced and self._seqs[req_id].request is not None:
                self._announced.add(req_id)
                new.append(self._seqs[req_id].request)
        plan = StepPlan(tuple(new), tuple(encode), tuple(prefill), tuple(self._finished),
                        self.encoder_cache.take_evicted())
        self._finished.clear()
        self._in_flight = plan
        self._in_flight_seqs = {w.req_id: self._seqs[w.req_id] for w in (*encode, *prefill)}
        return plan

    def complete(self, plan: StepPlan) -> list[str]:
        """Applies the step in flight as executed: its groups are encoded (their patch pages freed)
        and its chunks prefilled. Work of sequences removed meanwhile is ignored. After a failed step,
        `remove` its requests and then complete it, which returns the pages it held.

        Returns:
            req_ids whose prefill finished in this step; they keep their KV pages until `remove`.

        Raises:
            ValueError: `plan` is not the step in flight.
        """
        if plan is not self._in_flight:
            raise ValueError("complete() takes the plan that schedule() returned last, once")
        self.encoder_cache.stored([w.cache_key for w in plan.encode if w.cache_key is not None])
        for work in plan.encode:
            seq = self._live(work.req_id)
            if seq is not None:
                group = seq.group(work.item, work.index)
                if group.patch_pages is not None:  # None: found in a cached prefix meanwhile (_admit defers them)
                    self._patch.free(group.patch_pages)
                group.patch_pages = None
                group.encoded = True
        finished = []
        for work in plan.prefill:
            seq = self._live(work.req_id)
            if seq is not None:
                assert seq.num_computed_tokens == work.start, "chunks of a sequence must be contiguous"
                seq.num_computed_tokens = work.end
                page_size = self.config.kv_page_size
                for k in range(work.start // page_size, min(work.end // page_size, len(seq.block_hashes))):
                    self._kv.register(seq.block_table[k], seq.block_hashes[k])  # its KV is whole now
                if seq.prefill_done:
                    finished.append(seq.req_id)
                    self.encoder_cache.release(seq.req_id)  # its cached embeddings are in its KV now
        for allocator, pages in self._deferred:
            allocator.free(pages)
        self._deferred.clear()
        self._pages.deferred_freed()
        self._admit()
        self._in_flight = None
        self._in_flight_seqs = {}
        return finished

    def remove(self, req_id: str) -> None:
        """Drops a sequence (finished, failed or cancelled) and returns its KV and patch pages.

        Safe at any time and idempotent. Pages of a sequence that the step in flight uses return when
        that step completes, as the worker may still read or write them; all others are free at once,
        so the decode worker must have dropped the sequence (finished or aborted) before.
        """
        self._held.discard(req_id)
        self._pages.forget(req_id)
        self.encoder_cache.release(req_id)
        seq = self._seqs.pop(req_id, None)
        if seq is None:
            return
        if req_id in self._announced:
            self._announced.discard(req_id)
            self._finished.append(req_id)
        held = [(self._patch, g.patch_pages) for g in seq.groups if g.patch_pages is not None]
        if seq.block_table is not None:
            held.append((self._kv, seq.block_table))
        for group in seq.groups:
            group.patch_pages = None
        deferred = self._in_flight_seqs.get(req_id) is seq
        if deferred and seq.block_table is not None:
            self._pages.defer(seq)
        seq.block_table = None
        if deferred:
            self._deferred.extend(held)
        else:
            for allocator, pages in held:
                allocator.free(pages)
            self._admit()  # the pages freed may let waiting sequences in now

    def hold(self, req_id: str) -> None:
        """Plan no more work for ``req_id`` and never admit it, while it keeps its pages (its request is being
        stopped in the stages before ``remove`` returns them). Unknown ids are ignored."""
        if req_id in self._seqs:
            self._held.add(req_id)

    def get(self, req_id: str) -> Sequence | None:
        """The sequence `req_id` (e.g. its `block_table` for decode), or None once removed."""
        return self._seqs.get(req_id)

    def has_work(self) -> bool:
        """Some sequence still needs encode or prefill (schedule() may still return None while it
        waits for its media or for KV pages)."""
        return any(not seq.prefill_done for seq in self._seqs.values())

    def stats(self) -> SchedulerStats:
        """Current gauges; free pages exclude pages held back for the step in flight."""
        admitted = [seq for seq in self._seqs.values() if seq.block_table is not None]
        prefilled = sum(seq.prefill_done for seq in admitted)
        return SchedulerStats(
            num_waiting=len(self._seqs) - len(admitted),
            num_prefilling=len(admitted) - prefilled,
            num_prefilled=prefilled,
            step_in_flight=self._in_flight is not None,
            kv_pages_free=self._kv.num_free,
            kv_pages_total=self._kv.num_total,
            patch_pages_free=self._patch.num_free,
            patch_pages_total=self._patch.num_total,
            num_waiting_for_page=self.waiting_for_page,
        )

    def cache_stats(self) -> CacheStats:
        """The prefix cache's counts (``PrefixCache.stats``)."""
        return self._kv.stats()

    def _live(self, req_id: str) -> Sequence | None:
        """The sequence the step in flight planned for, unless it was removed (or replaced) since."""
        seq = self._seqs.get(req_id)
        return seq if seq is not None and self._in_flight_seqs.get(req_id) is seq else None

    def kv_pages_for(self, num_tokens: int) -> int:
        """KV pages that ``num_tokens`` tokens take (a sequence's worst case: prompt + max_tokens)."""
        return self._pages.pages_for(num_tokens)

    @property
    def kv_pages_total(self) -> int:
        return self._kv.num_total

    @property
    def kv_pages_free(self) -> int:
        return self._kv.num_free

    @property
    def waiting_for_page(self) -> int:
        """Sequences in decode refused the KV page their next tokens need (``KVGrants.num_short``)."""
        return self._pages.num_short

    def admits_now(self, prompt_tokens: int, max_tokens: int) -> bool:
        """Whether a sequence of ``prompt_tokens`` + ``max_tokens`` tokens, added now, would be admitted at once
        (behind the sequences already waiting, with their backfill rule: ``KVGrants.admission``). For routing a new
        request to a replica that can start it."""
        return len(self._seqs) in self._pages.admission(Sequence("", prompt_tokens, max_tokens))

    def grow(self, decoded: Iterable[str] = ()) -> dict[str, list[int]]:
        """Decode has made one more token of each of ``decoded`` (its first: the sequence has joined decode); returns
        the KV pages granted since the last call, per sequence, to append to its block table in decode
        (``KVGrants.grow``).

        Raises:
            KeyError: a sequence of ``decoded`` the scheduler does not hold.
        """
        return self._pages.grow(decoded)

    def _admit(self) -> None:
        """Grants the pages that sequences in decode want, then admits waiting ones (``KVGrants.admit``); a group in
        an admitted sequence's cached prefix is not encoded: its patch pages go back."""
        for seq in self._pages.admit():
            in_flight = self._in_flight_seqs.get(seq.req_id) is seq  # the step in flight may encode its groups
            for group in seq.groups:
                if seq.in_cached_prefix(group):  # its KV is there: nothing to encode
                    group.encoded = group.cached = True
                    if group.patch_pages is not None and in_flight:  # read by that step: back once it completes
                        self._deferred.append((self._patch, group.patch_pages))
                    elif group.patch_pages is not None:
                        self._patch.free(group.patch_pages)
                    group.patch_pages = None

    def _encode_work(self, seq: Sequence, group: Group) -> EncodeWork:
        """The work of encoding ``group``, its embeddings kept in the encoder cache where it makes room."""
        return EncodeWork(seq.req_id, group.item, group.index, tuple(group.patch_pages), group.num_patches,
                          group.token_offset, self.encoder_cache.reserve(seq.req_id, group))
