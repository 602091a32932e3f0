"""Decode pacing (``orchestrator/decode_pace.py``): which steps space decode's launches and by how much, and the
engine telling decode before such a step and ending it after (fake stages: ``fake_stages.py``)."""
from __future__ import annotations

import pytest

from backends.ipc.protocol import PrefillWork, StepPlan
from orchestrator.budget_policy import SloTargets
from orchestrator.decode_pace import DecodePacer
from tests.unit.orchestrator.test_engine import World, outputs_of, run, settle


def plan(*works: tuple[int, bool]) -> StepPlan:
    """A step prefilling ``(tokens, ends its prompt)`` per request."""
    return StepPlan((), (), tuple(PrefillWork(f"r{i}", 0, tokens, (), last) for i, (tokens, last) in enumerate(works)))


PACER = DecodePacer(40, 2048, SloTargets(tbt_ms={"text": 15.0}))  # image, video: 50 ms targets, 40 ms at most


@pytest.mark.parametrize("step, decoding, interval", [
    (plan((2048, True)), {"image"}, 40.0),             # a full step ending a prompt: the pacing, within 50 ms
    (plan((2048, True)), {"text"}, 12.0),              # 80% of text's 15-ms target: tighter than the pacing
    (plan((1500, False), (524, True)), {"image"}, 40.0),  # any prompt ending in it will do
    (plan((1024, True)), {"image"}, 40.0),             # half the budget is enough
    (plan((1023, True)), {"image"}, 0.0),              # a short step is over within a decode step or two
    (plan((2048, False)), {"image"}, 0.0),             # a video's chunk that ends no prompt: decode left alone
    (plan((2048, True)), set(), 0.0),                  # nothing decoding
    (plan((2048, True)), {"image", "text"}, 12.0),     # the tightest TBT target of the modalities decoding
    (plan((2048, True)), {"video"}, 40.0),
])
def test_which_steps_pace_decode_and_how_far_apart(step, decoding, interval):
    assert PACER.interval_ms(step, decoding) == interval


def test_decode_priority_boost_tightens_the_spacing():
    assert DecodePacer(40, 2048, SloTargets(), boost=2.0).interval_ms(plan((2048, True)), {"text"}) == 20.0


def test_the_engine_paces_decode_around_a_step_that_ends_prompts_only():
    """"a" decodes; "b"'s step ends its 40-token prompt (over half the 64-token budget): decode is paced before the
    step and released after it. "c"'s 20-token step is short: no pacing. Pacing off: never."""
    async def body(w: World):
        out = w.text("a", max_tokens=3)
        await outputs_of(out, 1)
        await outputs_of(w.text("b", prompt_len=40, max_tokens=1), 1)
        await outputs_of(w.text("c", prompt_len=20, max_tokens=1), 1)
        w.stages.emit(("a", 8, ""))
        w.stages.emit(("a", 9, "length"))
        await outputs_of(out, 2)
        await settle()
        calls = [entry for entry in w.log if entry[0] in ("step", "decode_pace")]
        assert calls == [("step", ("a",)), ("decode_pace", 30.0), ("step", ("b",)), ("decode_pace", 0.0),
                         ("step", ("c",))]
    run(body, prefill_budget=64, pacer=DecodePacer(30, 64))
