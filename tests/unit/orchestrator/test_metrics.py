"""The orchestrator's metrics (orchestrator/metrics.py): counters and histograms are summed in the process and sent
by their thread (no Triton call on the event loop's path), every series exists from 0, close sends what is left;
a request's timer measures TTFT, the gaps between outputs, end-to-end latency and its tokens; the engine's
record gives queue, prefill and decode times."""
from __future__ import annotations

import time

import pytest

from orchestrator.engine_io import Released
from orchestrator.metrics import (BUDGET_SCALE, DECODE, E2E, FINISHED_REASONS, HISTOGRAMS, ITL, PREFILL, QUEUE,
                                  SERVING, SUCCESS, TTFT, VISUAL, Metrics, RequestTimer, observe_engine_times)
from tests.unit.backends.triton.fake_metrics import install

PROMPT, GENERATED = "unifiedserve_prompt_tokens_total", "unifiedserve_generation_tokens_total"


@pytest.fixture
def registry(monkeypatch):
    return install(monkeypatch)


@pytest.fixture
def metrics(registry):
    m = Metrics(replicas=2, flush_s=3600.0)  # the thread never sends by itself: tests flush
    yield m
    m.close()


def count(registry, histogram: str) -> float:
    return registry.value(histogram + "_count")


def test_every_series_exists_from_zero(registry, metrics):
    assert {labels for labels in registry.values(SUCCESS)} == {(("finished_reason", r),) for r in FINISHED_REASONS}
    for name in HISTOGRAMS:
        assert count(registry, name) == 0 and registry.value(name + "_bucket", le="+Inf") == 0
    assert registry.value(PROMPT) == registry.value("unifiedserve_scheduler_steps_total") == 0


def test_every_replica_reads_as_serving_from_the_start(registry, metrics):
    """Triton's new gauge reads 0, which would say the replica has ended (the OpenAI API's /health: 503) until the
    first request starts the engines: set to 1 as the metrics are made, before the orchestrator's initialize
    returns."""
    assert registry.value(SERVING, replica="0") == registry.value(SERVING, replica="1") == 1


def test_every_replica_reads_budget_factor_1_from_the_start(registry, metrics):
    """Before the first request no budget factor has been applied: the configured budgets hold (factor 1), not 0."""
    assert registry.value(BUDGET_SCALE, replica="0") == registry.value(BUDGET_SCALE, replica="1") == 1


def test_updates_are_summed_and_sent_only_by_a_flush(registry, metrics):
    before = registry.calls
    for _ in range(1000):
        metrics.increment(GENERATED, by=2)
        metrics.observe(ITL, 0.02)
    metrics.increment(SUCCESS, "stop")
    assert registry.calls == before and registry.value(GENERATED) == 0  # nothing left for Triton yet
    metrics.flush()
    assert registry.value(GENERATED) == 2000 and registry.value(SUCCESS, finished_reason="stop") == 1
    assert count(registry, ITL) == 1000 and registry.value(ITL + "_bucket", le="0.015") == 0
    assert registry.value(ITL + "_bucket", le="0.02") == 1000
    # two counters, and the ITL buckets from 0.02 up with its sum and count
    assert registry.calls - before == 2 + sum(b >= 0.02 for b in HISTOGRAMS[ITL].bounds) + 3
    calls = registry.calls
    metrics.flush()
    assert registry.calls == calls  # nothing new, nothing sent


def test_the_thread_sends_every_period(registry):
    metrics = Metrics(flush_s=0.05)
    try:
        metrics.increment(GENERATED, by=3)
        deadline = time.monotonic() + 5
        while registry.value(GENERATED) != 3:
            assert time.monotonic() < deadline, "not sent"
            time.sleep(0.01)
    finally:
        metrics.close()


def test_close_sends_what_is_pending_and_nothing_after(registry, metrics):
    metrics.increment(GENERATED, by=4)
    metrics.observe(TTFT, 0.3)
    metrics.close()
    assert registry.value(GENERATED) == 4 and count(registry, TTFT) == 1
    metrics.increment(GENERATED)
    metrics.set("unifiedserve_kv_pages_free", 5)
    metrics.close()  # again (the fixture's): nothing is sent
    assert registry.value(GENERATED) == 4 and registry.value("unifiedserve_kv_pages_free") == 0


def _sent(registry, name: str, value: float, **labels) -> None:
    deadline = time.monotonic() + 5
    while registry.value(name, **labels) != value:
        assert time.monotonic() < deadline, f"{name} not sent"
        time.sleep(0.005)


def test_gauges_are_sent_soon_by_the_thread_not_by_the_caller(registry, metrics):
    before = registry.calls
    metrics.set("unifiedserve_kv_cache_usage_perc", 0.25)
    metrics.set("unifiedserve_replica_requests", 3, replica=1)
    _sent(registry, "unifiedserve_kv_cache_usage_perc", 0.25)  # flush_s is an hour: the thread woke for them
    _sent(registry, "unifiedserve_replica_requests", 3, replica="1")
    assert registry.calls - before == 2


def test_a_burst_of_changes_costs_one_send_per_gauge_and_repeats_none(registry):
    metrics = Metrics(flush_s=3600.0, gauge_period_s=1.0)
    try:
        metrics.set("unifiedserve_num_requests_running", 1)
        _sent(registry, "unifiedserve_num_requests_running", 1)
        before = registry.calls
        for n in range(2, 50):  # within the period after that send: they wait for the next one
            metrics.set("unifiedserve_num_requests_running", n)
        metrics.set("unifiedserve_kv_pages_free", 7)
        metrics.set("unifiedserve_kv_pages_free", 7)
        _sent(registry, "unifiedserve_num_requests_running", 49)
        _sent(registry, "unifiedserve_kv_pages_free", 7)
        assert registry.calls - before == 2
        metrics.set("unifiedserve_num_requests_running", 5)
        metrics.set("unifiedserve_num_requests_running", 49)  # back to what Triton has: nothing to send
        metrics.flush()
        assert registry.calls - before == 2
    finally:
        metrics.close()


def test_a_request_timer_measures_ttft_gaps_and_end_to_end(registry, metrics):
    timer = RequestTimer(metrics, arrived=100.0)
    timer.admitted(prompt_tokens=300, visual_tokens=256)
    timer.output(1, now=100.5)   # the first token, 0.5 s after arrival
    timer.output(3, now=100.52)  # three tokens that queued up: one output, one gap
    timer.output(1, now=100.6)
    timer.finished("length", now=100.7)
    metrics.flush()
    assert count(registry, TTFT) == 1 and registry.value(TTFT + "_sum") == pytest.approx(0.5)
    assert count(registry, ITL) == 2 and registry.value(ITL + "_sum") == pytest.approx(0.1)
    assert registry.value(ITL + "_bucket", le="0.02") == 1 and registry.value(ITL + "_bucket", le="0.075") == 1
    assert count(registry, E2E) == 1 and registry.value(E2E + "_sum") == pytest.approx(0.7)
    assert registry.value(PROMPT) == 300 and registry.value(GENERATED) == 5
    assert registry.value(VISUAL + "_bucket", le="256") == 1 and registry.value(VISUAL + "_bucket", le="64") == 0
    assert registry.value(SUCCESS, finished_reason="length") == 1


def test_a_refused_request_counts_its_reason_but_no_latency(registry, metrics):
    RequestTimer(metrics, arrived=time.monotonic()).finished("invalid")
    cancelled = RequestTimer(metrics, arrived=time.monotonic())
    cancelled.admitted(10, 0)
    cancelled.finished("abort")  # before its first token: latency, but no prompt tokens processed
    metrics.flush()
    assert registry.value(SUCCESS, finished_reason="invalid") == 1
    assert registry.value(SUCCESS, finished_reason="abort") == 1
    assert count(registry, E2E) == 1 and count(registry, TTFT) == 0 and registry.value(PROMPT) == 0
    assert registry.value(VISUAL + "_bucket", le="0") == 1


def test_engine_times_are_observed_once_reached(registry, metrics):
    observe_engine_times(metrics, Released("a", 0, False, admitted=10.0, scheduled=10.25, first_token=11.0,
                                           last_token=13.0))
    observe_engine_times(metrics, Released("b", 0, False, admitted=10.0, scheduled=0.0, first_token=0.0,
                                           last_token=0.0))  # aborted while waiting for KV pages
    observe_engine_times(metrics, Released("c", 0, False, admitted=10.0, scheduled=10.5, first_token=0.0,
                                           last_token=0.0))  # failed in its prefill
    metrics.flush()
    assert count(registry, QUEUE) == 2 and registry.value(QUEUE + "_sum") == pytest.approx(0.75)
    assert count(registry, PREFILL) == 1 and registry.value(PREFILL + "_sum") == pytest.approx(0.75)
    assert count(registry, DECODE) == 1 and registry.value(DECODE + "_sum") == pytest.approx(2.0)



def test_a_gauge_send_lets_go_of_the_gil_after_every_set(registry, metrics, monkeypatch):
    """The 2.51 stub keeps the GIL through a gauge set's round trip to Triton: the metrics thread yields after each
    (``triton_io.yield_gil``), so a send of many changed gauges does not hold the event loop for a switch interval."""
    yields = []
    monkeypatch.setattr("backends.triton.triton_io.yield_gil", lambda: yields.append(registry.calls))
    before = registry.calls
    for k, name in enumerate(("unifiedserve_kv_pages_free", "unifiedserve_num_requests_running",
                              "unifiedserve_num_requests_waiting")):
        metrics.set(name, 7 + k)
    metrics.send_gauges()
    assert registry.calls == before + 3 and yields == [before + 1, before + 2, before + 3]
