"""Decode pacing (``orchestrator/decode_pace.py``): which steps space decode's launches and by how much, and the
engine telling decode before such a step and ending it after its first tokens' admits; which steps join decode
(``serial_joins``) (fake stages: ``fake_stages.py``)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from backends.ipc.protocol import EncodeWork, PrefillWork, StepPlan
from orchestrator.budget_policy import SloTargets
from orchestrator.decode_pace import (HOLD_MIN_ENDING, HOLD_MIN_JOINING, PACE_FOR_MS, DecodePacer, Joins, holds_joins,
                                     joins_decode)
from tests.unit.orchestrator.test_engine import World, outputs_of, run, settle


def plan(*works: tuple[int, bool]) -> StepPlan:
    """A step prefilling ``(tokens, ends its prompt)`` per request."""
    return StepPlan((), (), tuple(PrefillWork(f"r{i}", 0, tokens, (), last) for i, (tokens, last) in enumerate(works)))


PACER = DecodePacer(40, 2048, SloTargets(tbt_ms={"text": 15.0}))  # image, video: 50 ms targets, 40 ms at most


def kinds(*names: str):
    """``kind_of`` for requests r0, r1, ... of these modalities."""
    return {f"r{i}": name for i, name in enumerate(names)}.get


@pytest.mark.parametrize("step, decoding, kind_of, interval", [
    (plan((2048, True)), ["image"], kinds("image"), 40.0),      # a full step ending a prompt: the pacing, within 50 ms
    (plan((2048, True)), ["text"], kinds("image"), 12.0),       # 80% of text's 15-ms target: tighter than the pacing
    (plan((1500, False), (524, True)), ["image"], kinds("text", "image"), 40.0),  # any image prompt ending will do
    (plan((1500, True), (524, False)), ["image"], kinds("text", "image"), 0.0),   # the image's chunk ends nothing
    (plan((1024, True)), ["image"], kinds("image"), 40.0),      # half the budget is enough
    (plan((1023, True)), ["image"], kinds("image"), 0.0),       # a short step is over within a decode step or two
    (plan((2048, False)), ["image"], kinds("video"), 0.0),      # a video's chunk that ends no prompt: decode left alone
    (plan((2048, True)), [], kinds("image"), 0.0),              # nothing decoding
    (plan((2048, True)), ["image", "text"], kinds("image"), 12.0),  # the tightest TBT target of the modalities decoding
    (plan((2048, True)), ["video"], kinds("video"), 0.0),      # a video's last chunk: never paced
    (plan((1500, True), (524, True)), ["text"], kinds("video", "text"), 0.0),  # nor with one text prompt beside it
    (plan((1500, True), (524, True)), ["text"], kinds("video", "image"), 12.0),  # an image ending beside it: paced
    (plan((2048, True)), ["text"], kinds("text"), 0.0),         # one text prompt, one stream decoding: not paced
    (plan((1024, True), (1024, True)), ["text"], kinds("text", "image"), 12.0),  # an image among them: paced
    (plan((2048, True)), ["text"], kinds(), 0.0),               # its request has gone
    # text prompts only: paced when they outnumber the requests decoding
    (plan((1024, True), (1024, True)), ["text"], kinds("text", "text"), 12.0),
    (plan((1024, True), (1024, True)), ["text", "text"], kinds("text", "text"), 0.0),
    (plan((1024, True), (1024, False), (10, True)), ["text", "image"], kinds("text", "text", "text"), 0.0),
    (plan(*[(117, True)] * 17), ["text"], kinds(*["text"] * 17), 12.0),  # the 32-request burst's second step
    (plan(*[(117, True)] * 11), ["text"] * 21, kinds(*["text"] * 11), 0.0),  # its last step: 21 streams decoding
    (plan((1024, True), (1024, True)), ["text"], kinds("text"), 0.0),  # one of the two has gone
])
def test_which_steps_pace_decode_and_how_far_apart(step, decoding, kind_of, interval):
    assert PACER.interval_ms(step, decoding, kind_of) == interval


def test_decode_priority_boost_tightens_the_spacing():
    pacer = DecodePacer(40, 2048, SloTargets(), boost=2.0)
    assert pacer.interval_ms(plan((2048, True)), ["text"], kinds("image")) == 20.0


async def _paced_step(w: World, decoding) -> tuple[tuple, list]:
    """Let ``decoding`` (request "a"'s output) end with two more tokens; then the one step decode was paced around
    (30 ms before it, released after it) and every step and pacing in order."""
    w.stages.emit(("a", 8, ""))
    w.stages.emit(("a", 9, "length"))
    await outputs_of(decoding, 2)
    await settle()
    calls = [entry for entry in w.log if entry[0] in ("step", "decode_pace")]
    paced = [k for k, entry in enumerate(calls) if entry[0] == "decode_pace"]
    assert [calls[k] for k in paced] == [("decode_pace", 30.0, PACE_FOR_MS), ("decode_pace", 0.0, 0.0)]
    assert paced[1] == paced[0] + 2
    return calls[paced[0] + 1], calls


def test_the_engine_paces_decode_around_the_step_that_ends_an_image_prompt_only():
    """"a" decodes; "b"'s last step encodes its image and ends its prompt (20 tokens, over half the 32-token
    budget): decode is paced before the step and released after it. "c"'s 20-token text prompt fills as much of a
    step but ends no media prompt (one prompt, one stream decoding), "d"'s 12 tokens are short: no pacing for either."""
    async def body(w: World):
        out = w.text("a", max_tokens=3)
        await outputs_of(out, 1)
        image = w.image("b", max_tokens=1)
        await settle()  # its 4 tokens before the image prefilled: a short step, no pacing
        w.media.ready("b", 0, 0, pages=1)
        w.media.finish("b", 0)
        await outputs_of(image, 1)
        await outputs_of(w.text("c", prompt_len=20, max_tokens=1), 1)
        await outputs_of(w.text("d", prompt_len=12, max_tokens=1), 1)
        step, calls = await _paced_step(w, out)
        assert step == ("step", ("b",))  # around b's last step only
        assert ("step", ("c",)) in calls and ("step", ("d",)) in calls
    run(body, prefill_budget=32, pacer=DecodePacer(30, 32))


def test_the_engine_paces_decode_around_a_step_that_ends_more_text_prompts_than_it_decodes():
    """"a" decodes; "b" and "c" (10 tokens each) arrive together and end their prompts in one step of 20 tokens, over
    half the 32-token budget: two prompts against one stream decoding, so decode is paced around that step. The
    pacing's end reaches decode after their admits, so they join its next launch while it still runs its steps one
    at a time."""
    async def body(w: World):
        out = w.text("a", max_tokens=3)
        await outputs_of(out, 1)
        b, c = w.text("b", prompt_len=10, max_tokens=2), w.text("c", prompt_len=10, max_tokens=2)
        await outputs_of(b, 1)
        await outputs_of(c, 1)
        await settle()
        start = w.log.index(("decode_pace", 30.0, PACE_FOR_MS))
        assert w.log[start + 1:start + 5] == [("step", ("b", "c")), ("admit", "b"), ("admit", "c"),
                                               ("decode_pace", 0.0, 0.0)]
        w.stages.emit(("b", 8, "length"), ("c", 8, "length"))
        step, _ = await _paced_step(w, out)
        assert step == ("step", ("b", "c"))
    run(body, prefill_budget=32, pacer=DecodePacer(30, 32))


@pytest.mark.parametrize("step, decoding, kind_of, joins", [
    (plan((117, True)), ["text"], kinds("text"), True),                # a text prompt ends beside a stream
    (plan((1280, True)), ["text"], kinds("image"), True),              # an image's
    (plan((2048, True)), ["text"], kinds("video"), False),             # a video's last chunk: not counted
    (plan((2048, False)), ["text"], kinds("text"), False),             # a middle chunk ends nothing
    (plan((117, True)), [], kinds("text"), False),                     # nothing decoding: decode's loop is idle
    (plan((117, True)), ["text"], kinds(), False),                     # its request has gone
])
def test_which_steps_join_decode(step, decoding, kind_of, joins):
    assert joins_decode(step, decoding, kind_of) is joins


@pytest.mark.parametrize("serial", [True, False])
def test_serial_joins_run_decode_one_step_at_a_time_around_a_step_that_ends_a_prompt_beside_it(serial):
    """With ``serial_joins``, "b"'s step (one text prompt beside "a"'s stream: not paced) is held by a pacing of
    interval 0, ended after "b"'s admit; without it decode hears nothing."""
    async def body(w: World):
        out = w.text("a", max_tokens=3)
        await outputs_of(out, 1)
        await outputs_of(w.text("b", prompt_len=10, max_tokens=2), 1)
        start = w.log.index(("step", ("b",)))
        held = [("decode_pace", 0.0, PACE_FOR_MS), ("step", ("b",)), ("admit", "b"), ("decode_pace", 0.0, 0.0)]
        assert (w.log[start - 1:start + 3] == held) is serial
        assert serial or not [entry for entry in w.log if entry[0] == "decode_pace"]
        w.stages.emit(("a", 8, ""), ("b", 8, ""))
        w.stages.emit(("a", 9, "length"), ("b", 9, "length"))
        await settle()
    run(body, prefill_budget=32, joins=Joins(serial=serial))


def image_plan(*works: tuple[int, bool]) -> StepPlan:
    """As :func:`plan`, the step also encoding 64 patches of r0's image."""
    return replace(plan(*works), encode=(EncodeWork("r0", 0, 0, (0,), 64, 4),))


@pytest.mark.parametrize("step, decoding, joining, kind_of, holds", [
    (plan(*[(117, True)] * 8), ["text"] * 24, 24, kinds(*["text"] * 8), True),  # the burst's second step
    (plan(*[(117, True)] * 14), ["text"] * 18, 17, kinds(*["text"] * 14), True),  # a lone stream beside the 17
    (plan(*[(117, True)] * 8), ["text"] * 24, 12, kinds(*["text"] * 8), False),  # half of them served already
    (plan(*[(117, True)] * 17), ["text"], 1, kinds(*["text"] * 17), False),  # the 17 beside the burst's first: paced
    (plan(*[(117, True)] * 10), ["text"] * 5, 5, kinds(*["text"] * 10), False),  # a closed loop's restart, 5 then 10
    (plan(*[(117, True)] * 3), ["text"] * 14, 11, kinds(*["text"] * 3), False),  # ... 11 then 3: a trickle, paced
    (plan((117, True)), ["text"] * 16, 0, kinds("text"), False),       # established streams: never held
    (plan((117, True)), [], 0, kinds("text"), False),                  # nothing decoding
    (plan((117, False)), ["text"], 1, kinds("text"), False),           # a chunk that ends nothing
    (plan((1280, True)), ["image"], 1, kinds("image"), False),         # an image prompt ends
    (plan((117, True), (2048, True)), ["text"], 1, kinds("text", "video"), False),  # a video's last chunk beside
    (image_plan((117, True)), ["text"], 1, kinds("text"), False),      # the step encodes
    (plan((117, True)), ["text"], 1, kinds(), False),                  # its request has gone
])
def test_which_steps_hold_decode_for_a_burst(step, decoding, joining, kind_of, holds):
    assert holds_joins(step, decoding, joining, kind_of) is holds


@pytest.mark.parametrize("hold", [True, False])
def test_hold_joins_holds_decode_while_a_burst_s_later_step_runs(hold):
    """A burst of HOLD_MIN_JOINING requests arrives together and is prefilled in one step; its later part, the
    HOLD_MIN_ENDING requests "c*", comes once they have their first tokens and no token from decode yet: with
    ``hold_joins`` decode is held (a pacing of interval PACE_FOR_MS) around their step, ended after their admits;
    without it decode hears nothing. Once the burst has had a decode token, the "d*" step is not held."""
    burst = [f"a{i}" for i in range(HOLD_MIN_JOINING)]
    later = tuple(f"c{i}" for i in range(HOLD_MIN_ENDING))

    async def body(w: World):
        outs = [w.text(name, prompt_len=10, max_tokens=3) for name in burst]
        for out in outs:
            await outputs_of(out, 1)
        cs = [w.text(name, prompt_len=10, max_tokens=2) for name in later]
        for c in cs:
            await outputs_of(c, 1)
        start = w.log.index(("step", later))
        held = [("decode_pace", PACE_FOR_MS, PACE_FOR_MS), ("step", later),
                *[("admit", name) for name in later], ("decode_pace", 0.0, 0.0)]
        assert (w.log[start - 1:start + len(held) - 1] == held) is hold
        w.stages.emit(*[(name, 8, "") for name in burst + list(later)])
        await outputs_of(outs[0], 1)
        ds = [w.text(f"d{i}", prompt_len=10, max_tokens=1) for i in range(HOLD_MIN_ENDING)]
        for d in ds:
            await outputs_of(d, 1)
        assert [entry for entry in w.log if entry[0] == "decode_pace"] == ([held[0], held[-1]] if hold else [])
        w.stages.emit(*[(name, 9, "length") for name in burst + list(later)])
        await settle()
    run(body, prefill_budget=10 * (HOLD_MIN_JOINING + HOLD_MIN_ENDING), joins=Joins(hold=hold))


def test_a_few_joining_streams_do_not_hold_decode():
    """Three streams new to decode beside none established (a closed loop's restarts near a scenario's end) are a
    majority but not a burst: holding decode for their later steps kept one stream's second token 130 ms on the
    H100."""
    burst = plan(*[(117, True)] * HOLD_MIN_ENDING)
    assert not holds_joins(burst, ["text"] * 3, 3, kinds(*["text"] * HOLD_MIN_ENDING))
    assert holds_joins(burst, ["text"] * HOLD_MIN_JOINING, HOLD_MIN_JOINING, kinds(*["text"] * HOLD_MIN_ENDING))


@pytest.mark.parametrize("name, field", [("serial_joins", "serial"), ("hold_joins", "hold")])
def test_the_orchestrator_reads_the_join_switches_and_names_a_bad_value(name, field):
    from orchestrator.config import OrchestratorConfig

    assert OrchestratorConfig.from_parameters({}).joins == Joins() == Joins(serial=False, hold=True)
    for value in ("on", "off"):
        assert getattr(OrchestratorConfig.from_parameters({name: value}).joins, field) is (value == "on")
    with pytest.raises(ValueError, match=f"parameter {name} must be on or off, got 'yes'"):
        OrchestratorConfig.from_parameters({name: "yes"})
