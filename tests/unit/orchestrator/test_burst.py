"""A step's wait for the rest of a burst (orchestrator/burst.py): only with two prompts or more waiting, until the
budget is full, the burst is over (nothing being admitted and nothing handed over for QUIET_S) or the wait's bound."""
from __future__ import annotations

import asyncio
import time

import pytest

from orchestrator import burst
from orchestrator.burst import Arrivals, gather_burst
from tests.unit.orchestrator.test_engine import World, outputs_of, run, settle

PROMPT = 117  # tokens a request brings (the peer benchmark's text question)


def _timed(waiting: int, wait_s: float, hand_overs: list[float] = (), admitting: int = 0,
           admission_s: float = 0.0, just_handed_over: bool = False) -> tuple[float, int]:
    """Seconds gather_burst waited with ``waiting`` prompts already waiting and ``admitting`` requests handed over,
    and the prompts waiting when it returned. Each of ``hand_overs`` (s after the start) hands a request over
    (Arrivals.note, as Triton's execute thread does); ``admission_s`` later it is admitted (a prompt more waiting,
    wake set), as is each of the ``admitting`` ones ``admission_s`` after the start. ``just_handed_over``: the last
    waiting prompt's request was handed over (and admitted) right before the start."""
    arrivals, state = Arrivals(), {"prompts": waiting}
    if just_handed_over:
        arrivals.note(1)
        arrivals.settle()
    arrivals.note(admitting)  # none: nothing noted, no hand-over time

    async def main():
        wake = asyncio.Event()

        def admitted():
            arrivals.settle()
            state["prompts"] += 1
            wake.set()

        def handed_over():
            arrivals.note(1)
            loop.call_later(admission_s, admitted)
        loop = asyncio.get_running_loop()
        for _ in range(admitting):
            loop.call_later(admission_s, admitted)
        for at in hand_overs:
            loop.call_later(at, handed_over)
        started = time.monotonic()
        await gather_burst(wake, arrivals, lambda: (state["prompts"], PROMPT * state["prompts"]), 2048, wait_s)
        return time.monotonic() - started, state["prompts"]
    return asyncio.run(main())


def test_off_does_not_wait():
    assert _timed(waiting=5, wait_s=0, admitting=3, admission_s=0.05)[1] == 5


# Where nothing may be waited for, the admissions come 1 s after the start and the bound is half that: a pause of the
# test process (a full garbage collection of its torch objects takes a tenth of a second or more) stays within it.


def test_a_lone_prompt_is_never_held():
    """The burst's first request goes alone even while the next ones are being admitted."""
    waited, prompts = _timed(waiting=1, wait_s=5, admitting=3, admission_s=1.0)
    assert prompts == 1 and waited < 0.5


def test_nothing_coming_does_not_wait(monkeypatch):
    """Nothing handed over: no quiet time to wait out (here 1 s long, so that waiting it would show)."""
    monkeypatch.setattr(burst, "QUIET_S", 1.0)
    waited, prompts = _timed(waiting=5, wait_s=5)
    assert prompts == 5 and waited < 0.5


def test_a_full_budget_does_not_wait():
    waited, prompts = _timed(waiting=18, wait_s=5, admitting=3, admission_s=1.0)  # 18 x 117 = 2,106 tokens
    assert prompts == 18 and waited < 0.5


@pytest.fixture
def quiet_50ms(monkeypatch):
    """QUIET_S of 50 ms, so that hand-overs 20 ms apart stay within it however late the event loop's timers fire."""
    monkeypatch.setattr(burst, "QUIET_S", 0.05)


def test_waits_through_a_trickle_until_the_budget_is_full(quiet_50ms):
    """Requests handed over 20 ms apart, each admitted 10 ms later (nothing being admitted half of the time: the
    rule before waited only while one was): the step waits for them until 18 prompts fill the budget."""
    waited, prompts = _timed(waiting=10, wait_s=5, hand_overs=[0.02 * k for k in range(1, 23)], admission_s=0.01,
                             just_handed_over=True)
    assert prompts == 18 and waited < 4


def test_the_burst_is_over_once_nothing_is_handed_over_for_the_quiet_time(quiet_50ms):
    waited, prompts = _timed(waiting=2, wait_s=5, hand_overs=[0.02, 0.04, 0.06], admission_s=0.01,
                             just_handed_over=True)
    assert prompts == 5 and 0.06 + 0.05 <= waited + 5e-3 and waited < 1


def test_waits_for_a_slow_admission():
    """A request handed over long ago and still being admitted (probing its media) is waited for."""
    waited, prompts = _timed(waiting=3, wait_s=5, admitting=1, admission_s=0.1)
    assert prompts == 4 and waited >= 0.09


def test_the_wait_is_bounded():
    waited, prompts = _timed(waiting=3, wait_s=0.05, admitting=2, admission_s=1.0)
    assert prompts == 3 and 0.04 <= waited < 0.9


@pytest.mark.parametrize("burst_wait_ms, steps", [(0, [("a",), ("b", "c"), ("d",)]), (200, [("a",), ("b", "c", "d")])])
def test_the_engine_plans_a_burst_in_one_step_after_its_first_request(burst_wait_ms, steps, quiet_50ms):
    """"a" goes alone; "b" and "c" come during its step; when it ends nothing is being admitted, and "d" is handed
    over 10 ms later (within the quiet time of "c"'s hand-over): with the wait, the next step holds all three."""
    arrivals = Arrivals()

    async def body(w: World):
        w.stages.hold_steps = True
        arrivals.note(1)
        outs = [w.text("a", max_tokens=1)]
        arrivals.settle()
        await settle()
        for name in ("b", "c"):
            arrivals.note(1)
            outs.append(w.text(name, max_tokens=1))
            arrivals.settle()
        w.stages.release_step()
        await asyncio.sleep(0.01)
        arrivals.note(1)  # "d": handed over, then admitted 5 ms later
        await asyncio.sleep(0.005)
        outs.append(w.text("d", max_tokens=1))
        arrivals.settle()
        w.engine.wake.set()
        for _ in range(3):
            await asyncio.sleep(0.06)
            w.stages.release_step()
        for out in outs:
            await outputs_of(out, 1)
        assert [entry[1] for entry in w.log if entry[0] == "step"] == steps
    run(body, burst_wait_ms=burst_wait_ms, arrivals=arrivals)
