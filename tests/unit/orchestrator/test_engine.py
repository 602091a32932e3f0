"""The engine against fake stages (tests/unit/orchestrator/fake_stages.py): admission, the prefill -> decode
handoff, a failed step, an abort in every state, a media failure, a lost decode stream and the drain. After every
test each KV and patch page is free again, and no page was freed while a stage could still write it."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from backends.ipc.protocol import INVALID_INPUT, SERVER_FAULT, MediaDecode, MediaGrid, NewRequest, SamplingParams, \
    StageFailure
from flashcodec.sampling import ImagePlan
from orchestrator.budget_policy import BudgetPolicy, SloTargets
from orchestrator.burst import Arrivals
from orchestrator.decode_pace import DecodePacer, Joins
from orchestrator.engine import Engine
from orchestrator.engine_io import SHUTTING_DOWN, EngineRequest, Output, Released, RequestState
from orchestrator.fewer_sms import FewerSms
from orchestrator.pages import PageAllocator
from orchestrator.prefix_cache import PrefixCache
from orchestrator.scheduler import Scheduler, SchedulerConfig
from orchestrator.sequence import Group
from orchestrator.timeline import NO_TIMELINE, Timeline
from tests.unit.orchestrator.fake_stages import FakeMedia, FakeStages

PAGE = 16


class World:
    """An engine over fake stages, with ``kv`` KV pages and 8 patch pages; ``log`` holds the calls in order,
    ``released`` the record of each request whose pages came back."""

    def __init__(self, kv: int = 32, prefill_budget: int = 2048, policy: BudgetPolicy | None = None,
                 pacer: DecodePacer | None = None, fewer_sms: FewerSms = FewerSms(), burst_wait_ms: int = 0,
                 arrivals: Arrivals | None = None, joins: Joins = Joins()):
        self.log: list = []
        self.kv, self.patch = PrefixCache(PageAllocator(kv, "kv")), PageAllocator(8, "patch")
        self.stages, self.media = FakeStages(self.log), FakeMedia(self.log, self.patch)
        config = SchedulerConfig(prefill_budget=prefill_budget, kv_page_size=PAGE, burst_wait_ms=burst_wait_ms)
        self.engine = Engine(0, Scheduler(config, self.kv, self.patch), self.patch, self.stages, self.media,
                             on_release=self._released, policy=policy, pacer=pacer, fewer_sms=fewer_sms,
                             arrivals=arrivals, joins=joins)
        self.released: dict = {}  # req_id -> its Released record

    def _released(self, r: Released) -> None:
        self.log.append(("freed", r.patch_pages_peak, r.had_media))
        self.released[r.req_id] = r

    def text(self, req_id: str, prompt_len: int = 20, max_tokens: int = 4) -> asyncio.Queue:
        new = NewRequest(req_id, tuple(range(prompt_len)), (), SamplingParams(), max_tokens)
        return self.engine.add(EngineRequest(new, ()))

    def image(self, req_id: str, max_tokens: int = 4, timeline: Timeline = NO_TIMELINE,
              names: tuple[str, ...] = (), kind: str = "image") -> asyncio.Queue:
        """A 24-token prompt whose tokens 4..19 are one image group of 64 patches (one patch page); ``names``: the
        request's ``media_names``; ``kind`` "video": the same group announced as a video's (the request's
        modality)."""
        new = NewRequest(req_id, tuple(range(24)), (MediaGrid(kind, (1, 8, 8)),), SamplingParams(), max_tokens)
        plan = ImagePlan(resized_height=112, resized_width=112, grid_thw=(1, 8, 8), num_patches=64, num_tokens=16)
        return self.engine.add(EngineRequest(new, (Group(0, 0, 4, 16, 64),),
                                             (MediaDecode(req_id, plan, data=b"png"),), (1,), timeline,
                                             media_names=names))

    def all_free(self) -> bool:
        return self.kv.num_free == self.kv.num_total and self.patch.num_free == self.patch.num_total


async def settle(rounds: int = 20) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


async def outputs_of(queue: asyncio.Queue, n: int) -> list[Output]:
    return [await asyncio.wait_for(queue.get(), 5) for _ in range(n)]


def run(test, **settings):
    async def main():
        world = World(**settings)
        await world.engine.start()
        try:
            await test(world)
            await settle()
            assert not world.engine.requests and world.all_free(), (world.kv.num_free, world.patch.num_free)
        finally:
            await world.engine.close()
    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_text_request_is_prefilled_handed_to_decode_and_freed_on_its_last_token():
    async def body(w: World):
        out = w.text("a", max_tokens=3)
        first = await outputs_of(out, 1)
        assert first == [Output(7)] and w.log[:2] == [("step", ("a",)), ("admit", "a")]
        assert w.engine.state("a") is RequestState.DECODING
        assert w.stages.plans[0].new[0].req_id == "a"
        w.stages.emit(("a", 8, ""))
        w.stages.emit(("a", 9, "length"))
        assert await outputs_of(out, 2) == [Output(8), Output(9, "length")]
        await settle()
        assert w.engine.state("a") is RequestState.FINISHED and ("freed", 0, False) in w.log
        assert "decode_abort" not in [entry[0] for entry in w.log]  # decode ended it itself
    run(body)


def test_a_first_token_that_ends_the_request_never_reaches_decode():
    async def body(w: World):
        out = w.text("a", max_tokens=1)
        assert await outputs_of(out, 1) == [Output(7, "length")]
        await settle()
        assert ("admit", "a") not in w.log
    run(body)


def test_the_next_plan_tells_the_stage_which_requests_it_may_forget():
    async def body(w: World):
        await outputs_of(w.text("a", max_tokens=1), 1)
        await settle()
        await outputs_of(w.text("b", max_tokens=1), 1)
        assert w.stages.plans[1].finished == ("a",) and [n.req_id for n in w.stages.plans[1].new] == ["b"]
    run(body)


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on():
    async def body(w: World):
        boom = StageFailure(SERVER_FAULT, "encode_prefill: RuntimeError: boom")
        w.stages.fail_next_step = boom
        assert await outputs_of(w.text("a"), 1) == [Output(failure=boom)]
        await settle()
        assert w.all_free()
        out = w.text("b", max_tokens=1)
        assert await outputs_of(out, 1) == [Output(7, "length")]
    run(body)


def test_the_released_record_times_queue_prefill_and_decode():
    """Queue time runs from ``add`` to the launch of the first step with the request's work (here it waits behind
    another request's step), prefill time from there to its first token, decode time to its last token."""
    async def body(w: World):
        w.stages.hold_steps = True
        w.text("a", max_tokens=1)
        await settle()
        out = w.text("b", max_tokens=3)  # added while a's step is in flight
        await asyncio.sleep(0.05)
        w.stages.release_step()  # a's step returns; b's is launched and held
        await settle()
        await asyncio.sleep(0.03)
        w.stages.release_step()
        await outputs_of(out, 1)
        w.stages.hold_steps = False
        await asyncio.sleep(0.03)
        w.stages.emit(("b", 8, ""))
        w.stages.emit(("b", 9, "length"))
        await outputs_of(out, 2)
        await settle()
        a, b = w.released["a"], w.released["b"]
        assert a.admitted <= a.scheduled <= a.first_token == a.last_token  # its first token ended it
        assert b.scheduled - b.admitted > 0.04 and b.first_token - b.scheduled > 0.02
        assert b.last_token - b.first_token > 0.02
    run(body)


def test_abort_while_waiting_for_kv_pages():
    async def body(w: World):
        await w.engine.close()
        small = World(kv=4)
        await small.engine.start()
        try:
            small.text("big", prompt_len=40, max_tokens=8)  # 3 of the 4 pages
            small.text("wait", prompt_len=40, max_tokens=8)  # needs 3 more: waits
            await settle()
            assert small.engine.state("wait") is RequestState.WAITING
            await small.engine.abort("wait")
            assert small.engine.state("wait") is RequestState.FINISHED
            assert small.released["wait"].scheduled == small.released["wait"].first_token == 0.0  # never ran
            assert not [e for e in small.log if e[0] == "step" and "wait" in e[1]]
            await small.engine.abort("big")
            assert small.all_free()
        finally:
            await small.engine.close()
        w.engine.requests.clear()
    asyncio.run(asyncio.wait_for(body(World()), 30))


def test_abort_while_encoding_waits_for_the_media_call_to_end_before_freeing_pages():
    async def body(w: World):
        w.image("a")
        await settle()
        assert w.engine.state("a") is RequestState.ENCODING  # its text waits for its image, not yet decoded
        w.media.ready("a", 0, 0, pages=1)  # reported while the abort is on its way
        await w.engine.abort("a")
        kinds = [entry[0] for entry in w.log]
        assert kinds.index("media_abort") < kinds.index("freed")
        assert ("admit", "a") not in w.log
    run(body)


def test_abort_while_prefilling_with_the_step_in_flight_never_admits_to_decode():
    async def body(w: World):
        w.stages.hold_steps = True
        out = w.text("a")
        await settle()
        assert w.engine.state("a") is RequestState.PREFILLING
        abort = asyncio.ensure_future(w.engine.abort("a"))
        await settle()
        w.stages.release_step()  # the step returns the first token after the abort
        await abort
        await settle()
        assert ("admit", "a") not in w.log and out.empty()
        w.stages.hold_steps = False
    run(body)


def test_abort_while_decoding_frees_only_after_decode_dropped_the_sequence():
    async def body(w: World):
        out = w.text("a", max_tokens=100)
        await outputs_of(out, 1)
        w.stages.emit(("a", 8, ""))
        await outputs_of(out, 1)
        await w.engine.abort("a")
        assert w.log[-2:] == [("decode_abort", "a"), ("freed", 0, False)]
        assert "a" not in w.stages.decoding
    run(body)


def test_a_media_item_that_will_not_decode_fails_its_request_as_bad_input():
    async def body(w: World):
        out = w.image("a")
        await settle()
        w.media.finish("a", 0, StageFailure(INVALID_INPUT, "image: not a decodable image"))
        assert await outputs_of(out, 1) == [Output(failure=StageFailure(INVALID_INPUT, "image: not a decodable image"))]
    run(body)


def test_a_media_items_decoding_error_names_it_as_the_request_does():
    """flashcodec knows only the item's kind; the client's error names its input and place (``media_names``)."""
    async def body(w: World):
        out = w.image("a", names=("image_url (item 2 of 2)",))
        await settle()
        w.media.finish("a", 0, StageFailure(INVALID_INPUT, "image: truncated or corrupt (image file is truncated)"))
        assert await outputs_of(out, 1) == [Output(failure=StageFailure(
            INVALID_INPUT, "image_url (item 2 of 2): truncated or corrupt (image file is truncated)"))]
        out = w.image("b", names=("image_url (item 1 of 2)",))
        await settle()
        w.media.finish("b", 0)  # ended early
        (failure,) = await outputs_of(out, 1)
        assert failure.failure.message == "image_url (item 1 of 2): decoding ended before all sampled frames were found"
    run(body)


def test_a_media_call_that_ends_before_every_group_is_bad_input():
    async def body(w: World):
        out = w.image("a")
        await settle()
        w.media.finish("a", 0)
        (failure,) = await outputs_of(out, 1)
        assert failure.failure.kind == INVALID_INPUT and "decoding ended before all sampled frames" in \
            failure.failure.message and failure.failure.message.startswith("image:")
    run(body)


def test_an_image_request_runs_to_its_end_and_its_patch_pages_return():
    async def body(w: World):
        out = w.image("a", max_tokens=2)
        await settle()
        w.media.ready("a", 0, 0, pages=1)
        w.media.finish("a", 0)
        assert await outputs_of(out, 1) == [Output(7)]
        assert w.stages.plans[-1].encode[0].token_offset == 4
        w.stages.emit(("a", 3, "length"))
        await outputs_of(out, 1)
        await settle()
        assert ("freed", 1, True) in w.log
    run(body)


def test_a_timeline_records_the_request_in_order():
    timeline = Timeline(time.monotonic())

    async def body(w: World):
        out = w.image("a", max_tokens=2, timeline=timeline)
        await settle()
        w.media.ready("a", 0, 0, pages=1)
        w.media.finish("a", 0)
        await outputs_of(out, 1)
        w.stages.emit(("a", 3, "length"), at=(timeline.arrived + 0.010, timeline.arrived + 0.015))
        await outputs_of(out, 1)
    run(body)
    tokens = json.loads(timeline.to_json())["tokens"]  # the decode token's way: launched, read, received
    assert tokens["decode_launched_us"] == [10000] and tokens["decode_read_us"] == [15000]
    assert len(tokens["received_us"]) == 1 and "sent_us" not in tokens  # nothing sent: no frontend here
    events = json.loads(timeline.to_json())["events"]
    names = [e["event"] for e in events]
    # the text before the image is prefilled while the image decodes: a step may come before group_ready
    assert names[0] == "engine_added" and names[-2:] == ["first_token", "last_token"]
    assert names.index("group_ready") < max(i for i, n in enumerate(names) if n == "step") < names.index("first_token")
    assert [e["ms"] for e in events] == sorted(e["ms"] for e in events)
    steps = [e for e in events if e["event"] == "step"]
    assert sum(s["encode_groups"] for s in steps) == 1 and sum(s["encode_patches"] for s in steps) == 64
    assert sum(s["prefill_tokens"] for s in steps) == 24  # the whole prompt
    assert all(s["launched_ms"] <= s["ms"] and s["worker_ms"] >= 0 for s in steps)


@pytest.mark.parametrize("with_policy", [False, True])
def test_an_slo_policy_sets_each_steps_budgets(with_policy):
    """Nothing decodes: the policy gives the largest budgets (8 x 16 tokens), so a 100-token prompt is prefilled in
    one step, where the fixed budget takes seven; with a stream decoding and its gaps over the TBT target, the
    next request's steps get the smallest (a quarter: 4 tokens)."""
    policy = BudgetPolicy(64, 16, SloTargets()) if with_policy else None

    async def body(w: World):
        out = w.text("a", prompt_len=100, max_tokens=8)
        assert await outputs_of(out, 1) == [Output(7)]
        assert [p.num_prefill_tokens for p in w.stages.plans] == ([100] if with_policy else [16] * 6 + [4])
        if with_policy:
            for gap in (800, 400, 200, 100, 51):  # ms between decode steps, over the 50-ms target and shrinking
                policy.observe_decode_gap(gap)  # with the budgets: 8 halved five times (the first gap of each
                policy.observe_decode_gap(gap)  # step spans the step before: not judged)
                w.engine._budgets()
            assert policy.scale == 0.25
            w.stages.plans.clear()
            w.text("b", prompt_len=10, max_tokens=2)
            await settle()
            assert w.stages.plans[0].num_prefill_tokens == 4
        for req_id in ("a", "b"):
            await w.engine.abort(req_id)
    run(body, prefill_budget=16, policy=policy)


def test_a_lost_decode_stream_fails_the_requests_in_decode():
    async def body(w: World):
        out = w.text("a", max_tokens=100)
        await outputs_of(out, 1)
        w.stages.end_decode(StageFailure(SERVER_FAULT, "decode: the stage closed its link"))
        (lost,) = await outputs_of(out, 1)
        assert lost.failure.message == "decode: the stage closed its link"
        await settle()
        assert w.engine.decode_ended and ("decode_abort", "a") not in w.log
    run(body)


def test_stop_fails_every_request_without_aborts_and_the_engine_drains():
    async def body(w: World):
        decoding, encoding = w.text("a", max_tokens=100), w.image("b")
        await outputs_of(decoding, 1)
        w.engine.stop()
        assert (await outputs_of(decoding, 1))[0].failure.message == SHUTTING_DOWN
        assert (await outputs_of(encoding, 1))[0].failure.message == SHUTTING_DOWN
        w.stages.end_decode()  # decode ends its stream when the server stops
        w.media.finish("b", 0)
        for _ in range(100):
            if not w.engine.busy():
                break
            await asyncio.sleep(0.01)
        assert not w.engine.busy()
        assert not [e for e in w.log if e[0] in ("decode_abort", "media_abort")]
    run(body)


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding"])
def test_abort_is_idempotent(state):
    async def body(w: World):
        out = w.text("a", max_tokens=100)
        if state != "waiting":
            await settle()
        if state == "decoding":
            await outputs_of(out, 1)
        await asyncio.gather(w.engine.abort("a"), w.engine.abort("a"))
        await w.engine.abort("a")
        assert [e for e in w.log if e[0] == "freed"] == [("freed", 0, False)]
    run(body)


def test_a_request_being_released_gets_no_more_steps():
    """While its media call is still ending (flashcodec finishes the group it decodes), an aborted request is held:
    the groups reported meanwhile are not encoded and no first token is sampled for it."""
    async def body(w: World):
        gate = asyncio.Event()
        media_abort = w.media.abort

        async def slow_abort(req_id: str) -> None:
            await gate.wait()
            await media_abort(req_id)

        w.media.abort = slow_abort
        w.image("a")
        await settle()
        steps = len(w.stages.plans)
        aborting = asyncio.ensure_future(w.engine.abort("a"))
        await settle()
        w.media.ready("a", 0, 0, pages=1)  # reported after the abort began
        await settle()
        assert len(w.stages.plans) == steps, w.stages.plans[steps:]
        gate.set()
        await aborting
        assert ("admit", "a") not in w.log
    run(body)
