"""KV pages granted as replies grow (Scheduler.grow, orchestrator/kv_grants.py): admission takes a prompt's pages
and two more, decode's tokens take the rest as they come, and the pool stays safe."""
from orchestrator.pages import PageAllocator
from orchestrator.prefix_cache import PrefixCache
from orchestrator.scheduler import Scheduler, SchedulerConfig
from orchestrator.sequence import Sequence


def make(kv_pages=64, **config):
    kv = PrefixCache(PageAllocator(kv_pages, "kv_pool"))
    return Scheduler(SchedulerConfig(**config), kv, PageAllocator(8, "patch_pool")), kv


def prefill(sched):
    """Run steps until no prefill is left; the sequences whose prompts ended."""
    done = []
    while (plan := sched.schedule()) is not None:
        done += sched.complete(plan)
    return done


def decode(sched, req_id, tokens):
    """``tokens`` more tokens of ``req_id`` from decode (its first: it joins decode); the pages granted meanwhile."""
    granted = {}
    for _ in range(tokens):
        for key, pages in sched.grow([req_id]).items():
            granted.setdefault(key, []).extend(pages)
    return granted


def test_chats_whose_worst_cases_overfill_the_pool_all_start():
    """Eight chats of 20 prompt tokens that may each run to 400 (27 pages at worst, 216 in all, the pool 64): all are
    admitted at once with 4 pages each, their prompt's and 32 tokens' (reserving every worst case, two would run and
    six wait)."""
    sched, kv = make()
    for i in range(8):
        sched.add(Sequence(f"c{i}", 20, 400))
    assert sched.stats().num_waiting == 0 and kv.num_free == 64 - 8 * 4
    assert sched.admits_now(20, 400)


def test_pages_follow_the_tokens_two_pages_ahead():
    """Granted once less than a page's tokens is left ahead, up to two pages ahead (or half the tokens made)."""
    sched, kv = make()
    sched.add(Sequence("a", 20, 100))  # pages for 20 + 1 + 32 tokens: 4
    assert prefill(sched) == ["a"] and len(sched.get("a").block_table) == 4
    table = list(sched.get("a").block_table)
    assert decode(sched, "a", 28) == {}  # 20 + 28 tokens: 16 more fit in the 4 pages
    granted = decode(sched, "a", 1)  # 29: 20 + 29 + 32 tokens take 6 pages
    assert granted == {"a": sched.get("a").block_table[4:]} and len(granted["a"]) == 2
    assert sched.get("a").block_table[:4] == table
    decode(sched, "a", 200)  # never past prompt + max_tokens: 8 pages
    assert len(sched.get("a").block_table) == 8 and kv.num_free == 56
    sched.remove("a")
    assert kv.num_free == 64


def run_decode(sched, seqs, steps=400):
    """Decode as the stage runs it: a sequence makes a token only where its pages hold that token's KV."""
    for _ in range(steps):
        for req_id in seqs:
            seq = sched.get(req_id)
            if seq.num_generated < seq.max_tokens and \
                    seq.prompt_len + seq.num_generated <= len(seq.block_table) * sched.config.kv_page_size:
                decode(sched, req_id, 1)


def test_a_sequence_refused_a_page_gets_it_once_another_ends():
    """Two sequences of 16 pages at worst in a pool of 20: each may finish alone, not both at once. Decoding side by
    side, one reaches its last token while the other waits for a page (never one that would leave neither able to
    finish); when the first ends, the other is granted its page (with the next `grow`) and finishes too."""
    sched, kv = make(kv_pages=20)
    sched.add(Sequence("a", 16, 240))
    sched.add(Sequence("b", 16, 240))
    prefill(sched)
    run_decode(sched, "ab")
    a, b = sched.get("a"), sched.get("b")
    assert a.num_generated == 240 and len(a.block_table) == 16
    held = len(b.block_table)  # its next token's KV would be the first past its pages: b waits
    assert b.num_generated < 240 and b.prompt_len + b.num_generated == held * 16 + 1
    assert sched.grow() == {} and sched.stats().num_waiting_for_page == 1
    sched.remove("a")
    assert sched.grow() == {"b": b.block_table[held:]} and len(b.block_table) > held
    assert sched.stats().num_waiting_for_page == 0
    run_decode(sched, "b")
    assert b.num_generated == 240 and len(b.block_table) == 16 and kv.num_free == 4


def test_a_waiting_prompt_is_admitted_only_where_the_others_can_still_finish():
    """A long prompt whose pages would leave neither it nor a running sequence able to reach its worst case waits;
    a short one that leaves room goes ahead (backfill), and the long one comes in once the running sequence has
    ended."""
    sched, kv = make()
    sched.add(Sequence("long_reply", 10, 790))  # 50 pages at worst, 3 now
    sched.add(Sequence("long_prompt", 700, 292))  # 62 at worst, 46 now: 15 left, fewer than its 16 more or 47
    sched.add(Sequence("short", 4, 8))  # 1 page at worst: within the 2 the pool leaves beside long_prompt's 62
    assert sched.get("long_prompt").block_table is None and sched.get("short").block_table is not None
    assert not sched.admits_now(700, 100) and sched.admits_now(10, 6)
    sched.remove("long_reply")
    assert sched.get("long_prompt").block_table is not None and kv.num_free == 64 - 1 - 46


def test_a_short_request_goes_ahead_of_a_long_reply_that_needs_its_pages_back():
    """A fresh user's case: a long reply's worst case needs nearly the whole pool; a short request whose pages
    come back when it ends (no prefix cache: the prompt's too) is admitted at once, not after the long reply; with
    the prefix cache, its full prompt pages may stay shared and do not count as coming back."""
    for hashes, admitted in (((), True), ((b"p1", b"p2"), False)):
        sched, _ = make()
        sched.add(Sequence("long", 96, 904))  # 63 pages at worst of the 64, 8 now: 55 more
        sched.add(Sequence("short", 32, 5, block_hashes=hashes))  # 3 pages, all it will ever hold: 53 left
        assert (sched.get("short").block_table is not None) == admitted


def test_pages_a_removed_sequence_holds_until_the_step_in_flight_ends_count_as_coming_back():
    """A prefill cancelled while its step runs keeps its pages until the step completes; meanwhile a sequence in
    decode that counts on them to finish is refused what the pool does not have, not granted pages it lacks (a
    reviewer's case: the grant failed and took the replica's decode stream down), and gets them once they are back."""
    sched, kv = make(kv_pages=30)
    sched.add(Sequence("b", 16, 192))
    prefill(sched)
    decode(sched, "b", 1)
    sched.add(Sequence("a", 16, 32))
    sched.add(Sequence("d", 208, 192))
    plan = sched.schedule()  # a's and d's prefill: the step in flight
    assert {w.req_id for w in plan.prefill} == {"a", "d"}
    run_decode(sched, "b")
    b = sched.get("b")
    assert b.num_generated < 192 and kv.num_free == 0
    sched.hold("a")
    sched.remove("a")  # its pages come back when the step completes
    assert sched.grow() == {} and kv.num_free == 0
    run_decode(sched, "b")  # b waits: nothing is free
    assert sched.stats().num_waiting_for_page == 1
    sched.complete(plan)
    assert b.block_table[-1] in sched.grow()["b"]
