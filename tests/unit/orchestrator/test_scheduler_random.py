"""Property tests: random workloads (arrivals, media streaming in out of order, cancellations, also mid-step,
decode writing tokens into KV pages granted as it goes, pausing where none is granted, its requests ending while a
step runs or after it (an end mid-step once admitted a waiting sequence whose groups the step was encoding, and
freed their patch pages under it: 2026-12-06); a third with budgets that change every step; a quarter whose prompts
share prefixes, with a prefix cache bounded by a random floor and ceiling) driven through the scheduler, checking
every plan, the KV pages' reference counts and that the pool stays safe.

As in the server, nothing reserves patch pages ahead: the simulated media stage takes a group's pages
when it has "decoded" that group (and only if they are free: back-pressure), then reports it. Half the
scenarios use the cross-process free list the server uses (backends/ipc/shared_pages.py)."""

import random
from dataclasses import replace

import pytest

from backends.ipc.shared_pages import SharedPageList
from orchestrator.encoder_cache import EncoderCache
from orchestrator.pages import PageAllocator
from orchestrator.prefix_cache import PrefixCache
from orchestrator.scheduler import Scheduler, SchedulerConfig
from orchestrator.sequence import STUB_TOKENS, Group, Sequence

MAX_TICKS = 5000


def random_sequence(rng, req_id, encode_budget):
    # leading text mostly a stub (Sequence.prefill_end), now and then longer than one
    offset, groups = rng.choice([rng.randint(1, 40), rng.randint(100, 300)]), []
    for item in range(rng.choice([0, 0, 1, 1, 2, 3])):
        offset += 1  # <|vision_start|>
        for index in range(rng.randint(1, 6)):
            # Mostly groups that fit the encode budget, now and then one that does not.
            tokens = rng.randint(1, max(1, encode_budget // 4 // rng.choice([1, 2, 3]) + rng.choice([0, 0, 0, 40])))
            groups.append(Group(item, index, offset, tokens, 4 * tokens))
            offset += tokens
        offset += 1 + rng.choice([rng.randint(0, 30), rng.randint(100, 300)])
    return Sequence(req_id, offset, rng.choice([rng.randint(1, 40), rng.randint(40, 400)]), groups)


def shared_prefixes(rng, seqs, page_size):
    """Block hashes that make prompts share prefixes: each prompt follows one of two families up to a random
    token, then its own hashes (a chain: once a page differs, every later one does)."""
    for seq in seqs.values():
        family, diverge = rng.randint(0, 1), rng.randint(0, seq.prompt_len)
        seq.block_hashes = tuple(f"{family}:{k}".encode() if (k + 1) * page_size <= diverge
                                 else f"{seq.req_id}:{k}".encode() for k in range(seq.prompt_len // page_size))


def shared_media(rng, seqs):
    """Encoder-cache keys that make media recur across prompts: a group's key names one of two media items and its
    index (the sizes of the groups a key names may differ here: the scheduler only counts them)."""
    for seq in seqs.values():
        for group in seq.groups:
            group.cache_key = f"m{rng.randint(0, 1)}:{group.index}".encode()


def check_encoder_cache(plan, stage_keys, claims, live):
    """The stage drops the plan's evicted keys, never one a living sequence has yet to copy."""
    for req_id, keys in claims.items():
        seq = live.get(req_id)
        if seq is not None and not seq.prefill_done:
            assert not set(keys) & set(plan.evict), "a pinned encoder-cache entry was evicted"
    stage_keys.difference_update(plan.evict)


def check_shared_pages(kv, live, config):
    """Every held page is counted once in the free pages; a page in several block tables lies in the cached prefix
    of all of its holders but (at most) the one that wrote it."""
    holders = {}
    for seq in live.values():
        for k, page in enumerate(seq.block_table or ()):
            holders.setdefault(page, []).append(k * config.kv_page_size < seq.num_cached_tokens)
    assert kv.num_free == kv.num_total - len(holders), "KV pages leaked or counted twice"
    for page, cached in holders.items():
        assert cached.count(False) <= 1, f"page {page} shared outside a cached prefix"


def demand_end(seq, encoding):
    """First prompt token whose embedding is not ready, or the prefill's start when the ready tokens are a stub of at
    most STUB_TOKENS before a group still being decoded: an independent reading of the rule."""
    for group in seq.groups:
        if group.token_end > seq.num_computed_tokens and not group.encoded and group.key not in encoding:
            end = max(group.token_offset, seq.num_computed_tokens)  # a group a cached prefix ends in
            visual = [g for g in seq.groups if g.token_end > seq.num_computed_tokens and g.token_offset < end]
            stub = 0 < end - seq.num_computed_tokens <= STUB_TOKENS and group.patch_pages is None and not visual
            return seq.num_computed_tokens if stub else end
    return seq.prompt_len


def pages(tokens, config):
    return -(-tokens // config.kv_page_size)


def kv_pages(seq, config):
    """KV pages a sequence may come to hold (prompt + max_tokens)."""
    return pages(seq.prompt_len + seq.max_tokens, config)


def first_pages(seq, config):
    """KV pages a sequence is admitted with: its prompt's, its first token's and kv_pages_ahead more, within prompt
    + max_tokens."""
    return pages(seq.prompt_len + min(seq.max_tokens, 1 + config.kv_pages_ahead * config.kv_page_size), config)


def worst_cases(live, config):
    """(pages each admitted sequence may still be granted, pages it returns whatever the others do: all it holds
    but its prompt's full pages, which the prefix cache may share)."""
    return [(kv_pages(seq, config) - len(seq.block_table), len(seq.block_table) - len(seq.block_hashes))
            for seq in live.values() if seq.block_table is not None]


def all_can_finish(free, cases):
    """The banker's check, read independently: finish whichever sequence can, until none is left or none can."""
    cases = list(cases)
    while cases:
        able = [c for c in cases if c[0] <= free]
        if not able:
            return False
        cases.remove(able[0])
        free += able[0][1]
    return True


def admissible(seq, free, cases, config):
    """The admission test: with ``seq`` holding its first pages, every sequence can still finish."""
    take = first_pages(seq, config)
    return take <= free and all_can_finish(free - take, [*cases, (kv_pages(seq, config) - take,
                                                                   take - len(seq.block_hashes))])


def is_short_step(config, plan, live):
    """A short step (``orchestrator.step_fill.short_prefills``): only prompts not started but for their cached prefix
    that end within ``short_prefill_tokens``, every embedding ready, within the budget, while other work waits."""
    if plan.encode or not plan.prefill or not config.short_prefill_tokens:
        return False
    for w in plan.prefill:
        seq = live[w.req_id]
        if not (w.is_last and w.end - w.start <= config.short_prefill_tokens and demand_end(seq, set()) == w.end
                and w.start == seq.num_cached_tokens):
            return False
    named = {w.req_id for w in plan.prefill}
    others = [seq for r, seq in live.items() if r not in named]
    return any(any(g.patch_pages is not None for g in seq.groups) or (
        seq.block_table is not None and demand_end(seq, set()) > seq.num_computed_tokens) for seq in others)


def check_plan(sched, config, plan, live, arrival, streak):
    """Returns the short steps in a row, this one included."""
    if is_short_step(config, plan, live):
        assert streak < config.max_short_steps, "more short steps in a row than max_short_steps"
        assert plan.num_prefill_tokens <= config.prefill_budget, "prefill budget exceeded"
        for seq in live.values():  # every short prefill that fits alongside is in
            left = seq.prompt_len - seq.num_computed_tokens
            if seq.block_table is not None and 0 < left <= config.short_prefill_tokens and \
                    seq.num_computed_tokens == seq.num_cached_tokens and \
                    demand_end(seq, set()) == seq.prompt_len and seq.req_id not in {w.req_id for w in plan.prefill}:
                assert plan.num_prefill_tokens + left > config.prefill_budget, "a short prefill left out"
        return streak + 1
    encode_total = sum(w.num_patches for w in plan.encode)
    assert encode_total == plan.num_encode_patches
    assert encode_total <= config.encode_budget or len(plan.encode) == 1, "encode budget exceeded"
    assert plan.num_prefill_tokens <= config.prefill_budget, "prefill budget exceeded"
    encoding = {}
    for w in plan.encode:
        group = live[w.req_id].group(w.item, w.index)
        assert not group.encoded and tuple(group.patch_pages) == w.patch_pages
        assert w.num_patches == group.num_patches, "a group was split"
        encoding.setdefault(w.req_id, set()).add(group.key)
    ready_first = [(arrival[s.req_id], s.req_id, g.key) for s in live.values() for g in s.groups
                   if g.patch_pages is not None]
    if ready_first:  # the oldest ready group always runs: encoding never starves, KV pool full or not
        _, req_id, key = min(ready_first)
        assert key in encoding.get(req_id, ()), "oldest ready group not encoded"
    for req_id, keys in encoding.items():
        ready = [g.key for g in live[req_id].groups if g.patch_pages is not None]
        assert ready[:len(keys)] == [k for k in ready if k in keys], "groups skipped out of prompt order"
    chunks = {w.req_id: w for w in plan.prefill}
    cap = max(1, int(config.max_share * config.prefill_budget))
    demands = {}
    for seq in live.values():
        if seq.block_table is None or seq.prefill_done:
            assert seq.req_id not in chunks
            continue
        demands[seq.req_id] = demand_end(seq, encoding.get(seq.req_id, set())) - seq.num_computed_tokens
        w = chunks.get(seq.req_id)
        if w is None:
            continue
        assert w.start == seq.num_computed_tokens < w.end <= seq.prompt_len and w.block_table == tuple(seq.block_table)
        assert w.is_last == (w.end == seq.prompt_len)
        for group in seq.groups:
            if group.token_offset < w.end and group.token_end > w.start:
                assert group.encoded or group.key in encoding.get(seq.req_id, ()), "prefill of an unencoded group"
    got = {req_id: (chunks[req_id].end - chunks[req_id].start if req_id in chunks else 0) for req_id in demands}
    if plan.num_prefill_tokens < config.prefill_budget:
        assert got == demands, "prefill budget left unused while ready tokens wait"
    if any(n > cap for n in got.values()):
        assert all(got[r] >= min(cap, demands[r]) for r in demands), "share cap not honoured"
    return 0


def check_admission(sched, config, live, arrival, newly_admitted, shared=False):
    """After schedule(): admission in arrival order with backfill. The first waiting sequence (the head) cannot be
    admitted safely; when sequences that arrived after it were admitted, the worst cases of all that arrived after
    it fit in what the pool leaves over beside the head's worst case; and no later sequence that fits that leftover
    and can be admitted safely is left waiting. ``shared``: prompts share cached pages, so the scheduler counts what
    a waiting sequence takes (its pages less those others hold), which these checks cannot see."""
    by_arrival = sorted(live.values(), key=lambda s: arrival[s.req_id])
    waiting = [i for i, seq in enumerate(by_arrival) if seq.block_table is None]
    if not waiting or shared:
        return
    free, cases = sched.stats().kv_pages_free, worst_cases(live, config)
    head = by_arrival[waiting[0]]
    assert not admissible(head, free, cases, config), "the first waiting sequence could be admitted but was not"
    later = [seq for seq in by_arrival[waiting[0] + 1:] if seq.block_table is not None]
    leftover = sched.stats().kv_pages_total - kv_pages(head, config) - sum(kv_pages(seq, config) for seq in later)
    if any(seq.req_id in newly_admitted for seq in later):
        assert leftover >= 0, "a later sequence went ahead into the pages the head may need"
    for seq in by_arrival[waiting[0] + 1:]:
        if seq.block_table is None:
            assert kv_pages(seq, config) > leftover or not admissible(seq, free, cases, config), \
                "a later sequence that fits beside the head's worst case was left waiting"


def take_grants(sched, live, grants):
    """The pages ``grow`` granted are the ends of their sequences' block tables, new to decode."""
    for req_id, granted in grants.items():
        table = live[req_id].block_table
        assert granted and table[len(table) - len(granted):] == granted


def decode_tokens(sched, live, decoding, config):
    """One decode step: each sequence of ``decoding`` (req_id -> the tokens it makes in all) makes a token where its
    KV pages reach, else waits; those done are removed (twice: ``remove`` is idempotent), their pages back."""
    for req_id in list(decoding):
        seq = live[req_id]
        if seq.num_generated >= decoding[req_id]:
            sched.remove(req_id)
            sched.remove(req_id)
            del live[req_id], decoding[req_id]
        elif seq.prompt_len + seq.num_generated <= len(seq.block_table) * config.kv_page_size:
            take_grants(sched, live, sched.grow([req_id]))


def check_idle(sched, live):
    """schedule() said None: nothing is ready to encode or prefill."""
    for seq in live.values():
        assert all(g.patch_pages is None for g in seq.groups)
        if seq.block_table is not None:
            assert seq.prefill_done or demand_end(seq, set()) == seq.num_computed_tokens


def run_scenario(seed, tmp_path):
    rng = random.Random(seed)
    config = SchedulerConfig(encode_budget=rng.choice([64, 256, 1000]), prefill_budget=rng.choice([16, 100, 512]),
                             max_share=rng.choice([1.0, 0.5, 0.3, 0.1]), kv_page_size=rng.choice([1, 4, 16]),
                             short_prefill_tokens=rng.choice([0, 0, 8, 64, 512]), max_short_steps=rng.choice([1, 4]),
                             kv_pages_ahead=rng.choice([1, 2, 3]))
    patch_page_size = rng.choice([16, 64, 256])
    arrivals = sorted((rng.randint(0, 60), f"r{i}") for i in range(rng.randint(1, 12)))
    seqs = {req_id: random_sequence(rng, req_id, config.encode_budget) for _, req_id in arrivals}
    need_kv = max(kv_pages(s, config) for s in seqs.values())
    group_pages = [-(-g.num_patches // patch_page_size) for s in seqs.values() for g in s.groups]
    shared = seed % 4 == 1
    floor = rng.randint(0, need_kv // 2) if shared else 0
    kv = PrefixCache(PageAllocator(floor + rng.randint(need_kv, 3 * need_kv), "kv_pool"), floor,
                     rng.choice([None, 0, need_kv // 3]) if shared else None)
    if shared:
        shared_prefixes(rng, seqs, config.kv_page_size)
        shared_media(rng, seqs)
    # Any pool that holds the largest group works (the orchestrator rejects larger groups at admission).
    num_patch_pages = max(group_pages, default=1) + rng.randint(0, 20)
    if seed % 2:
        patch = SharedPageList.create(tmp_path / f"patch_pool-{seed}.pages", num_patch_pages)
    else:
        patch = PageAllocator(num_patch_pages, "patch_pool")
    sched = Scheduler(config, kv, patch, EncoderCache(rng.choice([0, 50, 400, 4000]) if shared else 0))
    stage_keys, claims = set(), {}  # what the stage's encoder cache holds; each sequence's keys copied from it
    arrival = {req_id: t for t, req_id in arrivals}
    live, pending, decoding, decoded = {}, [], {}, []  # decoding: req_id -> tokens it will make in all
    in_decode_pages = 0  # patch pages the simulated media stage holds between decode and report
    streak = 0  # short steps in a row
    for tick in range(MAX_TICKS):
        for t, req_id in arrivals:
            if t == tick:
                sched.add(seqs[req_id])
                claims[req_id] = [g.cache_key for g in seqs[req_id].groups if g.cached and g.cache_key is not None
                                  and not seqs[req_id].in_cached_prefix(g)]
                assert set(claims[req_id]) <= stage_keys, "a group claimed from the encoder cache the stage lacks"
                live[req_id] = seqs[req_id]
                pending += [(req_id, g) for g in seqs[req_id].groups]
        # The media stage reports groups out of order, including those of requests cancelled meanwhile.
        for req_id, group, pages in decoded:
            sched.group_ready(req_id, group.item, group.index, pages)
        decoded, in_decode_pages = [], 0
        rng.shuffle(pending)
        for req_id, group in list(pending):
            pages = patch.allocate(-(-group.num_patches // patch_page_size)) if rng.random() < 0.5 else None
            if pages is not None:
                pending.remove((req_id, group))
                decoded.append((req_id, group, pages))
                in_decode_pages += len(pages)
        before = {r for r, seq in live.items() if seq.block_table is not None}
        step_config, budgets = config, None
        if seed % 3 == 0:  # budgets that change every step, as an SLO policy sets them (orchestrator.budget_policy)
            budgets = tuple(max(1, int(b * rng.choice([0.25, 0.5, 1, 2, 8])))
                            for b in (config.encode_budget, config.prefill_budget))
            step_config = replace(config, encode_budget=budgets[0], prefill_budget=budgets[1])
        plan = sched.schedule(budgets)
        if plan is not None:
            check_encoder_cache(plan, stage_keys, claims, live)
        check_admission(sched, config, live, arrival,
                        {r for r, seq in live.items() if seq.block_table is not None} - before, shared)
        if plan is None:
            check_idle(sched, live)
        else:
            streak = check_plan(sched, step_config, plan, live, arrival, streak)
        if live and rng.random() < 0.03:  # cancellation, possibly of a sequence in the step in flight
            victim = rng.choice(sorted(live))
            sched.remove(victim)
            del live[victim]
            decoding.pop(victim, None)
            pending = [(r, g) for r, g in pending if r != victim]
        if plan is not None:
            stage_keys.update(w.cache_key for w in plan.encode if w.cache_key is not None)
        during = rng.random() < 0.5  # decode's tokens and ends come while the step runs, or after it
        if during:
            decode_tokens(sched, live, decoding, config)
        for req_id in sched.complete(plan) if plan is not None else []:
            decoding[req_id] = rng.randint(1, live[req_id].max_tokens)  # an end of sequence before max_tokens
            take_grants(sched, live, sched.grow([req_id]))  # its first token, from prefill
        if not during:
            decode_tokens(sched, live, decoding, config)
        take_grants(sched, live, sched.grow())
        assert all_can_finish(kv.num_free, worst_cases(live, config)), "the KV pool is not safe"
        assert all(len(seq.block_table) <= kv_pages(seq, config) for seq in live.values() if seq.block_table)
        check_shared_pages(kv, live, config)
        held_patch = sum(len(g.patch_pages) for s in live.values() for g in s.groups if g.patch_pages is not None)
        assert patch.num_free + held_patch + in_decode_pages == patch.num_total, "patch pages leaked"
        if tick > arrivals[-1][0] and not live and not decoded:
            break
    else:
        pytest.fail(f"seed {seed}: requests still unfinished after {MAX_TICKS} ticks (starvation?)")
    assert not sched.has_work() and sched.schedule() is None
    assert kv.num_free == kv.num_total and patch.num_free == patch.num_total
    stats = kv.stats()
    assert stats.idle_pages == stats.cached_pages and kv._pages.num_free + stats.idle_pages == kv._pages.num_total
    return tick


@pytest.mark.parametrize("block", range(10))
def test_random_workloads_keep_the_invariants(block, tmp_path):
    for seed in range(block * 60, block * 60 + 60):
        run_scenario(seed, tmp_path)
