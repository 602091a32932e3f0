"""The decode stage's step metrics (backends/stages/decode_stage.py, StepMetrics): steps are binned on the send
thread and sent when the batch empties, once SEND_S has passed, or at close; never a round trip per step."""
from __future__ import annotations

import types

import pytest

from backends.stages import decode_stage
from backends.stages.decode_stage import STEP_SECONDS, StepMetrics
from tests.unit.backends.triton.fake_metrics import install

NAME = STEP_SECONDS.name


@pytest.fixture
def registry(monkeypatch):
    return install(monkeypatch)


def test_steps_are_sent_when_the_batch_empties(registry):
    metrics = StepMetrics(replica=1)
    assert registry.value(NAME + "_count", replica="1") == 0  # the series exist from the start
    calls = registry.calls
    for elapsed in (0.004, 0.006, 0.02):
        metrics.on_step(batch=8, elapsed=elapsed, idle=False)
    assert registry.calls == calls  # binned, not sent
    metrics.on_step(batch=8, elapsed=0.004, idle=True)  # the batch emptied after this step
    assert registry.value(NAME + "_count", replica="1") == 4
    assert registry.value(NAME + "_sum", replica="1") == pytest.approx(0.034)
    assert registry.value(NAME + "_bucket", replica="1", le="0.005") == 2
    assert registry.value(NAME + "_bucket", replica="1", le="0.0075") == 3
    assert registry.value("unifiedserve_decode_step_sequences_total", replica="1") == 32
    calls = registry.calls
    metrics.on_step(batch=0, elapsed=0.0, idle=True)  # nothing new: nothing sent
    assert registry.calls == calls
    metrics.close()


def test_a_busy_batch_is_sent_once_send_s_has_passed_and_at_close(registry, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(decode_stage, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    metrics = StepMetrics(replica=0)
    metrics.on_step(batch=2, elapsed=0.01, idle=False)
    clock[0] += decode_stage.SEND_S - 0.01
    metrics.on_step(batch=2, elapsed=0.01, idle=False)
    assert registry.value(NAME + "_count", replica="0") == 0
    clock[0] += 0.02
    metrics.on_step(batch=2, elapsed=0.01, idle=False)
    assert registry.value(NAME + "_count", replica="0") == 3
    metrics.on_step(batch=4, elapsed=0.01, idle=False)
    metrics.close()  # after the worker's shutdown
    assert registry.value(NAME + "_count", replica="0") == 4
    assert registry.value("unifiedserve_decode_step_sequences_total", replica="0") == 10
    metrics.on_step(batch=4, elapsed=0.01, idle=True)  # closed: nothing more
    assert registry.value(NAME + "_count", replica="0") == 4
