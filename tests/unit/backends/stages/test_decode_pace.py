"""The decode loop's pacing (``backends/stages/decode_pace.py``, ``DecodeWorker.pace``): the clock, and a paced loop
(tiny model on the CPU, and on CUDA where there is one; helpers of test_decode_worker_steps.py)."""
import queue
import time

import pytest
from pytest import approx

from backends.stages.decode_pace import Pacing
from tests.unit.backends.stages.test_decode_worker_steps import admit, alone, attach_queue, collect, worker_on
from tests.unit.backends.stages.test_decode_worker_steps import run_dir  # noqa: F401 (autouse: the run directory)


def test_launches_wait_for_the_interval_until_the_pacing_ends():
    pacing = Pacing.starting(40, 100, now=10.0)  # 40 ms apart until 10.1 s
    assert pacing.wait_s(last_launch=10.0, now=10.01) == approx(0.03)
    assert pacing.wait_s(last_launch=9.0, now=10.01) == 0.0        # the last launch is long past
    assert pacing.wait_s(last_launch=10.08, now=10.09) == approx(0.01)  # never past the pacing's end
    assert pacing.wait_s(last_launch=10.09, now=10.1) == 0.0       # over


def test_no_pacing():
    for pacing in (Pacing(), Pacing.starting(0, 100, now=1.0), Pacing.starting(40, 0, now=1.0)):
        assert pacing.wait_s(last_launch=1.0, now=1.0) == 0.0
    assert not Pacing().serial(1.0) and not Pacing.starting(40, 0, now=1.0).serial(1.0)


def test_a_pacing_of_interval_0_runs_the_steps_one_at_a_time_until_it_ends():
    pacing = Pacing.starting(0, 100, now=1.0)
    assert pacing.serial(1.05) and not pacing.serial(1.1)
    assert Pacing.starting(40, 100, now=1.0).serial(1.05)  # a spaced pacing too


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_steps_one_at_a_time_leave_none_in_flight_at_a_launch(device, monkeypatch):
    """With ``pace(0, ...)`` no step is launched while another is in flight (the overlap is off, so a sequence
    admitted meanwhile joins the next launch), and the tokens are those of the sequence stepped alone."""
    worker = worker_on(device, max_batch=2)
    in_flight_at_launch: list[bool] = []
    launch = worker._launch

    def watched_launch():
        in_flight_at_launch.append(worker._in_flight is not None)
        return launch()

    try:
        reference = alone(worker, first=5, page=1, steps=5)
        worker.eos_ids = []
        monkeypatch.setattr(worker, "_launch", watched_launch)
        worker.pace(0, 60_000)
        steps = attach_queue(worker)
        admit(worker, "a", 5, 1, max_tokens=5)
        tokens, _, _ = collect(steps, ["a"])
        assert tokens["a"] == reference
        assert len(in_flight_at_launch) >= 5 and not any(in_flight_at_launch), in_flight_at_launch
    finally:
        worker.shutdown()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_paced_loop_spaces_its_launches_and_streams_the_same_tokens(device, monkeypatch):
    """Paced 60 ms apart (``DecodeWorker.pace``), a sequence's steps are launched at least that far apart, with the
    tokens of the sequence stepped alone. (Launches, not the step messages' arrivals: a step slowed by a busy host
    delays its message, which then comes closer to the next one's.)"""
    worker = worker_on(device, max_batch=2)
    launches: list[float] = []
    launch = worker._launch

    def timed_launch():
        launched = launch()
        if launched is not None:
            launches.append(launched.started)
        return launched

    try:
        reference = alone(worker, first=5, page=1, steps=5)
        worker.eos_ids = []
        arrivals: queue.Queue = queue.Queue()
        monkeypatch.setattr(worker, "_launch", timed_launch)
        worker.pace(60, 60_000)
        worker.attach(lambda step: arrivals.put(step.token_ids[0]), lambda: None)
        admit(worker, "a", 5, 1, max_tokens=5)
        assert [arrivals.get(timeout=60) for _ in range(5)] == reference
        gaps = [later - earlier for earlier, later in zip(launches, launches[1:])]
        assert len(gaps) >= 4 and all(gap >= 0.059 for gap in gaps[:4]), gaps
    finally:
        worker.shutdown()


def test_the_pacing_counts_the_read_of_the_step_in_flight(monkeypatch):
    """Launches are paced from launch to launch: a read of the step in flight that takes 200 ms (a slow device) is part
    of the 300-ms spacing, not added to it (before the fix each launch came 300 ms after the read ended: 500 ms
    apart). The bound leaves 170 ms above the spacing for a pause of the test process (a full garbage collection of
    its torch objects takes a tenth of a second or more; with 120 and 80 ms the room was 70 ms)."""
    worker = worker_on("cpu", max_batch=2)
    launches: list[float] = []
    launch, read = worker._launch, worker._read

    def timed_launch():
        launched = launch()
        if launched is not None:
            launches.append(launched.started)
        return launched

    def slow_read(step):
        time.sleep(0.2)
        read(step)

    monkeypatch.setattr(worker, "_launch", timed_launch)
    monkeypatch.setattr(worker, "_read", slow_read)
    try:
        worker.eos_ids = []
        worker.pace(300, 60_000)
        steps = attach_queue(worker)
        admit(worker, "a", 5, 1, max_tokens=5)
        collect(steps, ["a"])
        gaps = [later - earlier for earlier, later in zip(launches, launches[1:])]
        assert len(gaps) == 4 and all(0.295 <= gap < 0.47 for gap in gaps), gaps
    finally:
        worker.shutdown()
