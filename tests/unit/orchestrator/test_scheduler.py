import pytest

from orchestrator.pages import PageAllocator
from orchestrator.prefix_cache import PrefixCache
from orchestrator.scheduler import Scheduler, SchedulerConfig, StepPlan
from orchestrator.sequence import STUB_TOKENS, Group, Sequence


def make(kv_pages=64, patch_pages=64, **config):
    kv, patch = PrefixCache(PageAllocator(kv_pages, "kv_pool")), PageAllocator(patch_pages, "patch_pool")
    return Scheduler(SchedulerConfig(**config), kv, patch), kv, patch


def step(sched):
    plan = sched.schedule()
    assert plan is not None
    return plan, sched.complete(plan)


def chunks(plan):
    return [(w.req_id, w.start, w.end) for w in plan.prefill]


def encoded(plan):
    return [(w.req_id, w.item, w.index) for w in plan.encode]


def video_seq(req_id, groups, text_before=10, text_after=5, max_tokens=8, tokens=16, patches=64):
    """A prompt of text, `groups` groups of one video back to back, then text."""
    layout = [Group(0, i, text_before + i * tokens, tokens, patches) for i in range(groups)]
    return Sequence(req_id, text_before + groups * tokens + text_after, max_tokens, layout)


def ready(sched, patch, seq):
    for group in seq.groups:
        sched.group_ready(seq.req_id, group.item, group.index, patch.allocate(1))


def test_text_prompt_is_prefilled_in_budget_sized_chunks():
    sched, kv, _ = make(kv_pages=400, prefill_budget=2048)
    sched.add(Sequence("a", 5000, 100))
    assert sched.stats().num_waiting == 0  # its pages are granted when it arrives, as they fit
    plans = [step(sched) for _ in range(3)]
    assert [chunks(p) for p, _ in plans] == [[("a", 0, 2048)], [("a", 2048, 4096)], [("a", 4096, 5000)]]
    assert [w.is_last for p, _ in plans for w in p.prefill] == [False, False, True]
    assert [f for _, f in plans] == [[], [], ["a"]]
    assert sched.get("a").block_table == list(plans[-1][0].prefill[0].block_table)
    assert plans[0][0].num_prefill_tokens == 2048
    assert len(plans[0][0].prefill[0].block_table) == -(-5032 // 16) == 400 - kv.num_free  # prompt + 2 pages ahead
    assert sched.schedule() is None and not sched.has_work()
    sched.remove("a")
    assert kv.num_free == 400 and sched.get("a") is None


def test_budgets_scale_while_nothing_decodes_and_not_while_decode_runs():
    sched, _, patch = make(kv_pages=400, prefill_budget=100, encode_budget=64, idle_budget_scale=3)
    seq = video_seq("v", groups=6, text_before=10, tokens=16, patches=64)  # 6 groups of 64 patches, 111 tokens
    sched.add(seq)
    sched.add(Sequence("t", 1000, 10))
    ready(sched, patch, seq)
    idle = sched.schedule(decode_running=False)  # 3 x 64 patches: three groups; 3 x 100 tokens
    assert len(idle.encode) == 3 and idle.num_prefill_tokens == 300
    sched.complete(idle)
    busy = sched.schedule(decode_running=True)  # the configured budgets
    assert len(busy.encode) == 1 and busy.num_prefill_tokens == 100
    sched.complete(busy)
    assert SchedulerConfig(idle_budget_scale=4).step_budgets(False) == (4 * 10240, 4 * 2048)
    assert SchedulerConfig(idle_budget_scale=4).step_budgets(True) == (10240, 2048)


def test_prefill_stops_before_an_unencoded_group_and_resumes_once_it_is_encoded():
    sched, kv, patch = make()
    seq = video_seq("v", groups=2, text_before=STUB_TOKENS + 1)  # text, two groups of 16 tokens, 5 tokens of text
    sched.add(seq)
    plan, _ = step(sched)
    assert chunks(plan) == [("v", 0, STUB_TOKENS + 1)] and plan.encode == ()  # longer than a stub: prefilled ahead
    assert sched.schedule() is None and sched.has_work()
    sched.group_ready("v", 0, 1, patch.allocate(1))  # out of order: group 1 first
    plan, _ = step(sched)
    assert encoded(plan) == [("v", 0, 1)] and plan.prefill == ()
    assert seq.groups[1].encoded and seq.groups[1].patch_pages is None and patch.num_free == 64
    sched.group_ready("v", 0, 0, pages := patch.allocate(2))
    plan, finished = step(sched)
    # The group encoded in this step counts: the worker runs the encode before the prefill.
    assert plan.encode[0].patch_pages == tuple(pages) and chunks(plan) == [("v", STUB_TOKENS + 1, seq.prompt_len)]
    assert finished == ["v"] and patch.num_free == 64


def test_a_stub_is_at_most_stub_tokens_long():
    sched, _, patch = make()
    at, over = (video_seq(name, groups=1, text_before=n) for name, n in [("at", STUB_TOKENS),
                                                                          ("over", STUB_TOKENS + 1)])
    sched.add(at)
    sched.add(over)
    plan, _ = step(sched)
    assert chunks(plan) == [("over", 0, STUB_TOKENS + 1)]  # "at" waits for its media


def test_a_text_stub_waits_for_its_media_while_it_is_decoded_not_while_it_waits_for_the_encoder():
    sched, _, patch = make(encode_budget=64)
    a, b = video_seq("a", groups=1, text_before=10), video_seq("b", groups=1, text_before=10)
    sched.add(a)
    sched.add(b)
    assert sched.schedule() is None  # both stubs wait: their groups are being decoded (no step of 20 tokens)
    ready(sched, patch, a)
    ready(sched, patch, b)
    plan, _ = step(sched)  # a's group fills the encode budget: b's waits for the encoder, so b's stub goes now
    assert encoded(plan) == [("a", 0, 0)] and chunks(plan) == [("a", 0, a.prompt_len), ("b", 0, 10)]
    plan, _ = step(sched)
    assert encoded(plan) == [("b", 0, 0)] and chunks(plan) == [("b", 10, b.prompt_len)]


def test_prefill_chunks_may_split_a_group():
    sched, _, patch = make(prefill_budget=16)
    seq = video_seq("v", groups=1, text_before=10)
    sched.add(seq)
    ready(sched, patch, seq)
    assert [chunks(step(sched)[0]) for _ in range(2)] == [[("v", 0, 16)], [("v", 16, 31)]]


def test_encoding_goes_on_while_the_kv_pool_is_full():
    sched, kv, patch = make(kv_pages=5, kv_page_size=16)
    hog = Sequence("hog", 56, 24)  # 5 pages: the whole pool
    sched.add(hog)
    step(sched)
    assert kv.num_free == 0
    seq = video_seq("v", groups=3)
    sched.add(seq)
    ready(sched, patch, seq)
    plan, _ = step(sched)
    assert encoded(plan) == [("v", 0, 0), ("v", 0, 1), ("v", 0, 2)] and plan.prefill == ()
    assert seq.block_table is None and sched.stats().num_waiting == 1
    sched.remove("hog")
    plan, finished = step(sched)
    assert plan.encode == () and chunks(plan) == [("v", 0, seq.prompt_len)] and finished == ["v"]


def test_a_later_request_goes_ahead_only_within_the_pages_the_waiting_one_leaves_over():
    sched, kv, _ = make(kv_pages=10, kv_page_size=16)
    for req_id, prompt_len in [("a", 100), ("big", 120), ("small", 10)]:
        sched.add(Sequence(req_id, prompt_len, 10))  # 7, 9 and 2 pages
    plan, _ = step(sched)
    assert chunks(plan) == [("a", 0, 100)]
    # "small" would fit in the 3 free pages, but the pool leaves only 10 - 9 = 1 over once "big" has its pages
    assert sched.stats().num_waiting == 2 and kv.num_free == 3
    sched.remove("a")
    assert chunks(step(sched)[0]) == [("big", 0, 120)]


def test_small_requests_go_ahead_of_a_large_one_that_waits_and_cannot_starve_it():
    sched, kv, _ = make(kv_pages=20, kv_page_size=16)
    for req_id, pages in [("a", 12), ("big", 10), ("s1", 2), ("s2", 5), ("s3", 4)]:
        sched.add(Sequence(req_id, 16 * pages - 10, 10))
    plan, _ = step(sched)
    # "big" waits (8 free); "s1" and "s2" go ahead (7 of the 20 - 10 pages "big" leaves over); "s3" waits
    # (4 pages, 1 free)
    assert [w.req_id for w in plan.prefill] == ["a", "s1", "s2"] and kv.num_free == 1
    assert sched.stats().num_waiting == 2
    sched.add(Sequence("s4", 6, 10))  # 1 page: still within the leftover (10 - 7 = 3)
    assert [w.req_id for w in step(sched)[0].prefill] == ["s4"]
    sched.remove("a")  # "big" fits beside everything that went ahead of it
    assert [w.req_id for w in step(sched)[0].prefill] == ["big"]
    assert sched.stats().num_waiting == 1  # "s3": 2 free pages, 4 needed


def test_a_group_larger_than_the_budget_runs_alone():
    sched, _, patch = make(encode_budget=100)
    small, huge = video_seq("small", 1, patches=60), video_seq("huge", 1, patches=250)
    sched.add(small)
    sched.add(huge)
    ready(sched, patch, small)
    ready(sched, patch, huge)
    plan, _ = step(sched)
    assert encoded(plan) == [("small", 0, 0)]  # the huge group waits: something is encoded already
    plan, _ = step(sched)
    assert encoded(plan) == [("huge", 0, 0)] and plan.num_encode_patches == 250


def test_groups_fill_the_encode_budget_in_prompt_order_then_fcfs():
    sched, _, patch = make(encode_budget=200)
    a, b = video_seq("a", 3, patches=80), video_seq("b", 2, patches=40)
    sched.add(a)
    sched.add(b)
    ready(sched, patch, a)
    ready(sched, patch, b)
    # a's third group does not fit; b's first one does (a's order is kept, b may use the rest).
    assert encoded(step(sched)[0]) == [("a", 0, 0), ("a", 0, 1), ("b", 0, 0)]
    assert encoded(step(sched)[0]) == [("a", 0, 2), ("b", 0, 1)]


def test_max_share_splits_the_prefill_budget_and_gives_the_rest_back():
    sched, _, _ = make(kv_pages=400, prefill_budget=100, max_share=0.5)
    sched.add(Sequence("a", 1000, 1))
    sched.add(Sequence("b", 1000, 1))
    sched.add(Sequence("c", 1000, 1))
    assert chunks(step(sched)[0]) == [("a", 0, 50), ("b", 0, 50)]
    sched.remove("b")
    sched.remove("c")
    sched.add(Sequence("d", 10, 1))
    # d takes what it needs; a, alone with demand left, takes the rest.
    assert chunks(step(sched)[0]) == [("a", 50, 140), ("d", 0, 10)]
    assert chunks(step(sched)[0]) == [("a", 140, 240)]


def test_max_share_caps_encode_but_never_a_first_group():
    sched, _, patch = make(encode_budget=100, max_share=0.3)
    a, b = video_seq("a", 3, patches=40), video_seq("b", 3, patches=20)
    sched.add(a)
    sched.add(b)
    ready(sched, patch, a)
    ready(sched, patch, b)
    # Pass 1: a's first group (40 > 30, exempt), b's first one (20); pass 2: the rest, FCFS.
    assert encoded(step(sched)[0]) == [("a", 0, 0), ("b", 0, 0), ("a", 0, 1)]


def test_a_prefill_about_to_end_its_prompt_gets_a_short_step_ahead_of_a_long_prompts_work():
    sched, _, patch = make(kv_pages=400, encode_budget=100, prefill_budget=100, max_share=0.5,
                           short_prefill_tokens=20)
    long = video_seq("long", groups=3, patches=40)
    sched.add(long)
    ready(sched, patch, long)
    step(sched)
    sched.add(Sequence("question", 15, 4))  # a later question: all text, within 20 tokens of its end
    sched.add(Sequence("text", 30, 4))  # more than 20 tokens left: a normal step's
    plan, finished = step(sched)
    assert chunks(plan) == [("question", 0, 15)] and plan.encode == () and finished == ["question"]
    plan, _ = step(sched)  # back to normal steps: the long prompt and the other request share it
    assert [w.req_id for w in plan.prefill] == ["long", "text"] and encoded(plan) == [("long", 0, 2)]


def test_the_last_chunk_of_a_long_prompt_goes_into_the_next_normal_step_not_a_short_one():
    sched, _, _ = make(kv_pages=400, prefill_budget=100, max_share=0.5, short_prefill_tokens=50)
    for name in "abcd":
        sched.add(Sequence(name, 70, 1))  # like images at once: each more than half the budget
    assert chunks(step(sched)[0]) == [("a", 0, 50), ("b", 0, 50)]
    plan, finished = step(sched)  # a's and b's 20-token tails share a normal step with c and d
    assert chunks(plan) == [("a", 50, 70), ("b", 50, 70), ("c", 0, 50), ("d", 0, 10)]
    assert finished == ["a", "b"] and sched._short_streak == 0


def test_a_short_step_waits_for_its_media_and_is_not_taken_when_nothing_else_waits():
    sched, _, patch = make(kv_pages=400, prefill_budget=100, short_prefill_tokens=50)
    image = video_seq("image", groups=1, text_before=2, text_after=2)  # 20 tokens, its group not yet decoded
    sched.add(image)
    sched.add(Sequence("big", 1000, 1))
    assert chunks(step(sched)[0]) == [("big", 0, 100)]  # the image's group is not ready (its stub waits): normal
    ready(sched, patch, image)
    plan, _ = step(sched)  # ready only once encoded, and its encode is a normal step's
    assert encoded(plan) == [("image", 0, 0)] and chunks(plan) == [("image", 0, 20), ("big", 100, 180)]
    sched.remove("big")
    sched.add(Sequence("alone", 10, 1))
    plan, _ = step(sched)  # nothing else waits: the same as a normal step
    assert chunks(plan) == [("alone", 0, 10)] and sched._short_streak == 0


def test_short_steps_in_a_row_are_bounded_so_a_long_prompt_still_progresses():
    sched, _, _ = make(kv_pages=400, prefill_budget=100, max_share=0.5, short_prefill_tokens=10, max_short_steps=2)
    sched.add(Sequence("long", 1000, 1))
    owners = []
    for k in range(6):
        sched.add(Sequence(f"q{k}", 5, 1))  # a short one arrives before every step
        owners.append([w.req_id for w in step(sched)[0].prefill])
    assert owners == [["q0"], ["q1"], ["long", "q2"], ["q3"], ["q4"], ["long", "q5"]]


def test_remove_mid_flight_returns_the_pages_when_the_step_completes():
    sched, kv, patch = make(prefill_budget=16)
    seq = video_seq("v", groups=2)
    sched.add(seq)
    ready(sched, patch, seq)
    plan = sched.schedule()
    assert encoded(plan) == [("v", 0, 0), ("v", 0, 1)] and chunks(plan) == [("v", 0, 16)]
    sched.remove("v")
    sched.remove("v")
    # The worker may still be reading those patches and writing that KV.
    assert kv.num_free < 64 and patch.num_free == 62 and not sched.has_work()
    assert sched.complete(plan) == []
    assert kv.num_free == 64 and patch.num_free == 64 and sched.schedule() is None


def test_remove_mid_prefill_returns_everything_at_once():
    sched, kv, patch = make(prefill_budget=16)
    seq = video_seq("v", groups=3)
    sched.add(seq)
    sched.group_ready("v", 0, 0, patch.allocate(2))
    step(sched)
    sched.group_ready("v", 0, 2, patch.allocate(3))
    assert seq.num_computed_tokens == 16 and patch.num_free == 61
    sched.remove("v")
    assert kv.num_free == 64 and patch.num_free == 64
    assert sched.group_ready("v", 0, 1, patch.allocate(4)) == "gone"  # late report of a cancelled request
    assert patch.num_free == 64


def test_complete_ignores_a_request_replaced_mid_flight():
    sched, kv, _ = make()
    sched.add(Sequence("r", 40, 4))
    plan = sched.schedule()
    sched.remove("r")
    sched.add(fresh := Sequence("r", 40, 4))
    assert sched.complete(plan) == [] and fresh.num_computed_tokens == 0
    assert chunks(step(sched)[0]) == [("r", 0, 40)]


def test_one_step_in_flight_at_a_time():
    sched, _, _ = make()
    sched.add(Sequence("a", 40, 4))
    plan = sched.schedule()
    assert sched.stats().step_in_flight
    with pytest.raises(RuntimeError):
        sched.schedule()
    with pytest.raises(ValueError):
        sched.complete(StepPlan((), (), ()))
    sched.complete(plan)
    with pytest.raises(ValueError):
        sched.complete(plan)


def test_add_and_group_ready_reject_bad_input():
    sched, _, patch = make(kv_pages=4, kv_page_size=16)
    sched.add(video_seq("v", 1))
    with pytest.raises(ValueError, match="already"):
        sched.add(Sequence("v", 4, 4))
    with pytest.raises(ValueError, match="KV pages"):
        sched.add(Sequence("long", 60, 5))
    with pytest.raises(ValueError, match="not a new"):
        sched.add(Sequence("old", 4, 4, num_computed_tokens=2))
    with pytest.raises(KeyError):
        sched.group_ready("v", 0, 5, [0])
    sched.group_ready("v", 0, 0, patch.allocate(1))
    with pytest.raises(ValueError, match="twice"):
        sched.group_ready("v", 0, 0, [1])


@pytest.mark.parametrize("groups", [
    [Group(0, 0, 5, 4, 16), Group(0, 1, 7, 4, 16)],  # overlap
    [Group(0, 0, 18, 4, 16)],  # past the prompt
    [Group(0, 0, 2, 0, 16)],  # no tokens
    [Group(0, 0, 2, 4, 16), Group(0, 0, 8, 4, 16)],  # same name
])
def test_sequence_rejects_a_bad_group_layout(groups):
    with pytest.raises(ValueError):
        Sequence("s", 20, 4, groups)


@pytest.mark.parametrize("kwargs", [
    {"encode_budget": 0}, {"prefill_budget": -1}, {"kv_page_size": 1.5}, {"max_share": 0}, {"max_share": 1.5},
    {"short_prefill_tokens": -1}, {"max_short_steps": 0}, {"idle_budget_scale": 0}, {"idle_budget_scale": 1.5},
])
def test_config_is_checked(kwargs):
    with pytest.raises(ValueError):
        SchedulerConfig(**kwargs)


def test_the_orchestrator_shares_a_step_by_default_and_names_a_bad_max_share():
    """A long video's prefill must not hold a short request back (a user waited 8-29 s behind one with FCFS)."""
    from orchestrator.config import OrchestratorConfig

    assert OrchestratorConfig.from_parameters({}).scheduler.max_share == 0.5
    assert OrchestratorConfig.from_parameters({}).scheduler.short_prefill_tokens == 512
    assert OrchestratorConfig.from_parameters({}).scheduler.idle_budget_scale == 1  # off until measured
    assert OrchestratorConfig.from_parameters({"idle_budget_scale": "4"}).scheduler.idle_budget_scale == 4
    assert OrchestratorConfig.from_parameters({"short_prefill_tokens": "0"}).scheduler.short_prefill_tokens == 0
    with pytest.raises(ValueError, match="short_prefill_tokens"):
        OrchestratorConfig.from_parameters({"short_prefill_tokens": "-3"})
    assert OrchestratorConfig.from_parameters({"max_share": "1"}).scheduler.max_share == 1.0
    for bad in ("half", "0", "1.5"):
        with pytest.raises(ValueError, match="max_share"):
            OrchestratorConfig.from_parameters({"max_share": bad})


def test_admission_does_not_wait_for_the_step_in_flight():
    """A sequence arriving while a step runs gets its KV pages at once when they fit (so "waiting" means the pool
    cannot hold it now), and one waiting for pages gets them as soon as a sequence outside the step frees them."""
    sched, kv, _ = make(kv_pages=20)
    sched.add(Sequence("a", 100, 60))  # 10 pages
    plan = sched.schedule()
    sched.add(Sequence("b", 100, 60))  # 10 more, while a's step is in flight
    sched.add(Sequence("c", 100, 60))  # does not fit: waits
    assert sched.get("b").block_table is not None and sched.get("c").block_table is None
    assert sched.stats().num_waiting == 1 and sched.stats().step_in_flight
    sched.remove("b")  # not in the step in flight: its pages are free at once, and c takes them
    assert sched.get("c").block_table is not None and sched.stats().num_waiting == 0
    sched.complete(plan)


def test_a_held_sequence_is_planned_no_more_and_never_admitted_but_keeps_its_pages():
    """The engine holds a request while the stages let go of it (abort, then free): no step works on it meanwhile."""
    sched, kv, _ = make(kv_pages=20)
    sched.add(Sequence("a", 100, 60))  # admitted: 9 pages (its prompt and 2 pages ahead) of its 10
    sched.add(Sequence("b", 200, 60))  # 15 pages now (its prompt and 2 pages ahead): more than the 11 free; it waits
    sched.hold("a")
    sched.hold("b")
    assert sched.schedule() is None  # a's prefill is not planned
    assert kv.num_free == 11 and sched.get("b").block_table is None
    sched.add(Sequence("c", 100, 60))  # b, held, does not stand in its way
    assert sched.get("c").block_table is not None
    sched.remove("a")
    sched.remove("b")
    assert kv.num_free == 11
