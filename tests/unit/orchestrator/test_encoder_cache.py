"""The encoder cache's mirror (orchestrator/encoder_cache.py) alone and in the scheduler: keys kept once their step
completes, pinned while a request will copy them, evicted least recently used first and told to the stage, groups
found there neither decoded nor encoded."""
import pytest

from orchestrator.encoder_cache import EncoderCache, group_key
from orchestrator.pages import PageAllocator
from orchestrator.prefix_cache import PrefixCache
from orchestrator.scheduler import Scheduler, SchedulerConfig
from orchestrator.sequence import Group, Sequence


def image_seq(req_id, identity, tokens=8, offset=5):
    """Text, one image of ``tokens`` tokens named ``identity``, text."""
    return Sequence(req_id, offset + tokens + 5, 4, [Group(0, 0, offset, tokens, 4 * tokens,
                                                           cache_key=group_key(identity, 0))])


def make(capacity):
    patch = PageAllocator(16, "patch")
    sched = Scheduler(SchedulerConfig(kv_page_size=4), PrefixCache(PageAllocator(64, "kv")), patch,
                      EncoderCache(capacity))
    return sched, patch


def serve(sched, patch, seq):
    """Media decoded where needed, then steps until its prefill ends; the plans."""
    for group in seq.groups:
        if not group.encoded:
            sched.group_ready(seq.req_id, group.item, group.index, patch.allocate(1))
    plans = []
    while not seq.prefill_done:
        plans.append(sched.schedule())
        sched.complete(plans[-1])
    return plans


def test_keys_name_the_item_and_the_group():
    assert group_key(b"a" * 16, 1) != group_key(b"a" * 16, 2) != group_key(b"b" * 16, 1)
    with pytest.raises(ValueError, match="encoder_cache_tokens"):
        EncoderCache(-1)


def test_the_same_image_elsewhere_in_a_prompt_is_copied_not_encoded():
    sched, patch = make(capacity=32)
    first = image_seq("a", b"i" * 16)
    sched.add(first)
    plans = serve(sched, patch, first)
    key = group_key(b"i" * 16, 0)
    assert [w.cache_key for p in plans for w in p.encode] == [key]
    sched.remove("a")
    again = image_seq("b", b"i" * 16, offset=9)  # another position: no shared prefix, the same image
    again.request = None
    sched.add(again)
    assert again.groups[0].encoded and again.groups[0].cached
    assert sched.group_ready("b", 0, 0, patch.allocate(1)) == "cached" and patch.num_free == 16
    plans = serve(sched, patch, again)
    assert all(not p.encode for p in plans)
    stats = sched.encoder_cache.stats()
    assert (stats.queried_tokens, stats.hit_tokens, stats.tokens) == (16, 8, 8)


def test_the_cached_embeds_go_with_the_new_request():
    from backends.ipc.protocol import NewRequest, SamplingParams

    sched, patch = make(capacity=32)
    sched.add(first := image_seq("a", b"i" * 16))
    serve(sched, patch, first)
    seq = image_seq("b", b"i" * 16, offset=9)
    seq.request = NewRequest("b", (0,) * seq.prompt_len, (), SamplingParams(), 4)
    sched.add(seq)
    plan = sched.schedule()
    assert plan.new[0].cached_embeds == ((9, group_key(b"i" * 16, 0)),)


def test_least_recently_used_keys_are_evicted_and_sent_but_pinned_ones_stay():
    sched, patch = make(capacity=16)
    for name in (b"x", b"y"):
        sched.add(seq := image_seq(name.decode(), name * 16))
        serve(sched, patch, seq)
    sched.remove("x")
    sched.remove("y")
    waiting = image_seq("w", b"x" * 16)  # claims x: pinned until its prefill ends
    sched.add(waiting)
    third = image_seq("z", b"z" * 16)
    sched.add(third)
    for group in third.groups:
        sched.group_ready("z", 0, group.index, patch.allocate(1))
    plan = sched.schedule()
    assert plan.evict == (group_key(b"y" * 16, 0),)  # y, not the pinned x
    assert [w.cache_key for w in plan.encode] == [group_key(b"z" * 16, 0)]
    sched.complete(plan)
    stats = sched.encoder_cache.stats()
    assert (stats.tokens, stats.evicted_tokens) == (16, 8)
    large = image_seq("v", b"v" * 16, tokens=20)  # larger than the whole cache: encoded, not kept
    sched.add(large)
    sched.group_ready("v", 0, 0, patch.allocate(1))
    assert [w.cache_key for w in sched.schedule().encode] == [None]


def test_a_key_whose_step_never_completed_for_its_request_is_dropped():
    sched, patch = make(capacity=16)
    seq = image_seq("a", b"a" * 16)
    sched.add(seq)
    sched.group_ready("a", 0, 0, patch.allocate(1))
    plan = sched.schedule()
    sched.remove("a")  # failed or cancelled in the step in flight
    sched.complete(plan)
    assert sched.encoder_cache.stats().tokens == 0
    assert sched.schedule() is None and sched.encoder_cache.take_evicted() == (group_key(b"a" * 16, 0),)
