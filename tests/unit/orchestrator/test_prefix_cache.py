"""The prefix cache (orchestrator/prefix_cache.py) alone and in the scheduler: block hashes, reference counts,
eviction and the cache's region, cached prefixes counted as computed, media groups in them never decoded or
encoded, and pages written once cached."""
import pytest

from orchestrator.pages import PageAllocator
from orchestrator.prefix_cache import CacheConfig, PrefixCache, block_hashes
from orchestrator.scheduler import Scheduler, SchedulerConfig
from orchestrator.sequence import Group, Sequence

PAGE = 4


def test_block_hashes_name_the_prompt_up_to_each_full_page_and_its_media():
    ids = list(range(10))
    hashes = block_hashes(ids, [], PAGE)
    assert len(hashes) == 2 and len(set(hashes)) == 2  # the partial last page has none
    assert block_hashes(ids[:8] + [99, 98], [], PAGE) == hashes  # a different tail: the same full pages
    changed = block_hashes([7] + ids[1:], [], PAGE)
    assert changed[0] != hashes[0] and changed[1] != hashes[1]  # a chain: page 1 names page 0 too
    # the same placeholder ids, other media: other hashes from the first page the media touches
    video_a, video_b = block_hashes(ids, [(5, 8, b"a")], PAGE), block_hashes(ids, [(5, 8, b"b")], PAGE)
    assert video_a[0] == video_b[0] == hashes[0] and video_a[1] != video_b[1]


def pool(pages=8, floor=0, ceiling=None):
    return PrefixCache(PageAllocator(pages, "kv"), floor, ceiling)


def test_pages_are_shared_by_reference_and_idle_once_no_sequence_holds_them():
    kv = pool()
    a = kv.grant([], 3, 0, 0)
    kv.register(a[0], b"h0")
    kv.register(a[1], b"h1")
    assert kv.lookup([b"h0", b"h1", b"h2"]) == a[:2] and kv.lookup([b"h2", b"h0"]) == []
    b = kv.grant(a[:2], 1, prompt_tokens=10, hit_tokens=8)
    assert b[:2] == a[:2] and kv.num_free == 8 - 4  # the two shared pages counted once
    kv.free(a)
    assert kv.num_free == 8 - 3  # a's own page freed, the shared ones still held by b
    kv.free(b)
    stats = kv.stats()
    assert kv.num_free == 8 and stats.idle_pages == stats.cached_pages == 2
    assert (stats.queried_tokens, stats.hit_tokens) == (10, 8)
    with pytest.raises(ValueError, match="not all held"):
        kv.free(b[:1])  # double free: nothing changes
    assert kv.stats().idle_pages == 2


def test_idle_pages_are_evicted_least_recently_released_first_when_pages_are_needed():
    kv = pool(pages=4)
    first, second = kv.grant([], 1, 0, 0), kv.grant([], 1, 0, 0)
    kv.register(first[0], b"first")
    kv.register(second[0], b"second")
    kv.free(first)
    kv.free(second)
    assert kv.cost(3, []) == 3 <= kv.num_free == 4
    kv.grant([], 3, 0, 0)  # two free pages, then the least recently released idle one
    assert kv.lookup([b"first"]) == [] and kv.lookup([b"second"]) == second
    assert kv.stats().evictions == 1
    assert kv.cost(1, second) == 1  # an idle hit takes a page of the region
    assert kv.grant(second, 0, 4, 4) == second and kv.num_free == 0


def test_the_region_floor_keeps_pages_from_sequences_and_the_ceiling_bounds_idle_pages():
    kv = pool(pages=8, floor=2, ceiling=1)
    assert kv.num_total == 6 and kv.grant([], 7, 0, 0) is None
    pages = kv.grant([], 3, 0, 0)
    for i, page in enumerate(pages):
        kv.register(page, bytes([i]))
    kv.free(pages)
    stats = kv.stats()
    assert stats.idle_pages == stats.cached_pages == 1 and stats.evictions == 2
    assert kv.lookup([bytes([0])]) == pages[:1]  # the prompt's start is kept: its end went first
    with pytest.raises(ValueError, match="floor"):
        pool(pages=4, floor=4)


def test_cache_config_from_parameters_and_its_pool():
    assert CacheConfig.from_parameters({}) == CacheConfig(True, 0.0, 1.0)
    config = CacheConfig.from_parameters({"prefix_caching": "false", "prefix_cache_floor": "0.25",
                                          "prefix_cache_ceiling": "0.5"})
    assert not config.enabled and (config.pool(PageAllocator(10, "kv")).floor, config.pool(
        PageAllocator(10, "kv")).ceiling) == (2, 5)
    for bad in ({"prefix_caching": "yes"}, {"prefix_cache_floor": "1"}, {"prefix_cache_ceiling": "x"}):
        with pytest.raises(ValueError, match="prefix_cach"):
            CacheConfig.from_parameters(bad)


def video_prompt(req_id, question, groups=2, tokens=8):
    """Text [0, 6), ``groups`` groups of a video, a question of ``len(question)`` tokens: ids and groups."""
    ids = [1] * 6 + [0] * (groups * tokens) + list(question)
    media = [Group(0, g, 6 + g * tokens, tokens, 4 * tokens) for g in range(groups)]
    hashes = block_hashes(ids, [(6, 6 + groups * tokens, b"video")], PAGE)
    return Sequence(req_id, len(ids), 4, media, block_hashes=hashes)


def run(sched, patch, seq):
    """Decode every group the sequence still needs, then steps until its prefill ends; the steps' prefill chunks."""
    for group in seq.groups:
        if not group.encoded:
            assert sched.group_ready(seq.req_id, 0, group.index, patch.allocate(1)) == "taken"
    chunks = []
    while not seq.prefill_done:
        plan = sched.schedule()
        chunks += [(w.start, w.end) for w in plan.prefill]
        sched.complete(plan)
    return chunks


def test_a_follow_up_question_shares_the_cached_video_and_prefills_only_its_new_tokens():
    kv, patch = pool(pages=64), PageAllocator(16, "patch")
    sched = Scheduler(SchedulerConfig(kv_page_size=PAGE), kv, patch)
    first = video_prompt("first", [5, 6, 7, 8, 9])  # 27 tokens: pages 0..5 full
    sched.add(first)
    assert run(sched, patch, first) == [(0, 27)]
    follow = video_prompt("follow", [5, 6, 3])  # the same first 24 tokens, another question
    sched.add(follow)
    assert follow.num_cached_tokens == follow.num_computed_tokens == 24
    assert all(g.encoded for g in follow.groups)  # never decoded nor encoded
    assert sched.group_ready("follow", 0, 0, patch.allocate(1)) == "cached" and patch.num_free == 16
    assert follow.block_table[:6] == first.block_table[:6]
    assert run(sched, patch, follow) == [(24, 25)]
    sched.remove("first")
    assert kv.stats().hit_tokens == 24 and kv.num_free == 64 - len(follow.block_table)
    sched.remove("follow")
    assert kv.num_free == 64 and kv.stats().idle_pages == 6


def test_a_sequence_that_does_not_read_the_cache_computes_every_token_and_still_caches_its_pages():
    """``reads_cache`` False (a prompt whose every position's log probabilities are asked): no hit, its groups
    decoded and its whole prompt prefilled, its lookup not counted; its pages are cached for the next sequence."""
    kv, patch = pool(pages=64), PageAllocator(16, "patch")
    sched = Scheduler(SchedulerConfig(kv_page_size=PAGE), kv, patch)
    for req_id in ("scored", "scored again"):
        scored = video_prompt(req_id, [5, 6, 7, 8, 9])
        scored.reads_cache = False
        sched.add(scored)
        assert scored.num_cached_tokens == 0 and not any(g.encoded for g in scored.groups)
        assert run(sched, patch, scored) == [(0, 27)]
    assert kv.stats().queried_tokens == 0
    after = video_prompt("after", [5, 6, 7, 8, 1])  # finds the pages the first one cached
    sched.add(after)
    assert after.num_cached_tokens == 24 and kv.stats().queried_tokens == 27


def test_a_cached_prefix_stops_short_of_the_last_token_and_a_group_it_ends_in_is_encoded_again():
    kv, patch = pool(pages=64), PageAllocator(16, "patch")
    sched = Scheduler(SchedulerConfig(kv_page_size=PAGE), kv, patch)
    first = video_prompt("a", [5, 6, 7, 8, 9, 10])  # 28 tokens: seven full pages
    sched.add(first)
    run(sched, patch, first)
    same = video_prompt("b", [5, 6, 7, 8, 9, 10])  # all seven cached: the last is computed again for its logits
    sched.add(same)
    assert same.num_cached_tokens == 24 and run(sched, patch, same) == [(24, 28)]
    other = Sequence("c", 28, 4, [Group(0, 0, 6, 20, 80)], block_hashes=first.block_hashes)  # a group to token 26
    sched.add(other)
    assert other.num_cached_tokens == 24 and not other.groups[0].encoded
    assert sched.schedule() is None  # its tokens 24.. wait for the group
    assert run(sched, patch, other) == [(24, 28)]  # encoded whole, its rows from 24 on prefilled


def test_a_block_tables_end_is_evicted_before_the_prefix_it_extends():
    kv = pool(pages=6, ceiling=2)
    pages = kv.grant([], 4, 0, 0)
    for k, page in enumerate(pages):
        kv.register(page, f"h{k}".encode())
    kv.free(pages)  # idle beyond the ceiling: the end goes, the start stays reachable
    assert kv.lookup([b"h0", b"h1", b"h2"]) == pages[:2]
    kv.grant([], 5, 0, 0)  # one more page needed than is free: the prompt's last idle page is evicted first
    assert kv.lookup([b"h0", b"h1"]) == pages[:1]


def test_a_waiting_sequence_admitted_with_a_cached_prefix_while_its_groups_are_encoded_frees_them_after_the_step():
    """A sequence waiting for KV pages has its groups encoded (encoding runs ahead of admission); another request's
    end admits it during that step, with the groups in its cached prefix: their patch pages go back once the step
    has completed (the worker reads them until then), and completing the step does not free them twice. A fresh
    user's heavy run (the same video in several requests, cancellations) once ended the step loop here with a
    TypeError (2026-12-06)."""
    kv, patch = pool(pages=16), PageAllocator(16, "patch")
    sched = Scheduler(SchedulerConfig(kv_page_size=PAGE), kv, patch)
    first = video_prompt("first", [5, 6, 7, 8, 9])
    sched.add(first)
    run(sched, patch, first)
    blocker = Sequence("blocker", 4 * (kv.num_free - 1), 1)  # the pages left but for one
    sched.add(blocker)
    while not blocker.prefill_done:  # in decode, not in the next step
        sched.complete(sched.schedule())
    follow = video_prompt("follow", [5, 6, 3])
    sched.add(follow)
    assert follow.block_table is None  # waits for KV pages
    for group in follow.groups:
        assert sched.group_ready("follow", 0, group.index, patch.allocate(1)) == "taken"
    plan = sched.schedule()
    assert ("follow", 0, 0) in [(w.req_id, w.item, w.index) for w in plan.encode]
    sched.remove("blocker")  # during the step: "follow" is admitted, its groups in the cached prefix
    assert follow.num_cached_tokens == 24 and all(g.encoded for g in follow.groups)
    assert patch.num_free == 16 - 2  # not while the step in flight still reads them
    sched.complete(plan)
    assert patch.num_free == 16
    assert run(sched, patch, follow) == [(24, 25)]
