"""Histograms binned in the process and sent to Triton as counters (backends/triton/histograms.py): the buckets
follow Prometheus' ``le`` rule, a flush sends each series' increments in a bounded number of calls, and what the
counters add up to is what a histogram fed the same observations one by one would show."""
from __future__ import annotations

import math
import random

import pytest

from backends.triton.histograms import Bins, CounterHistogram, Delta, HistogramSpec, le_label
from tests.unit.backends.triton.fake_metrics import install

SPEC = HistogramSpec("test_latency_seconds", "a latency", (0.01, 0.1, 1.0))


def test_le_labels_are_written_as_prometheus_clients_write_them():
    assert [le_label(b) for b in (0.0025, 0.5, 1.0, 60.0, 7680.0, 0.0)] == ["0.0025", "0.5", "1", "60", "7680", "0"]
    assert le_label(math.inf) == "+Inf" and SPEC.le_labels == ("0.01", "0.1", "1", "+Inf")


@pytest.mark.parametrize("bounds", [(), (1.0, 1.0), (2.0, 1.0), (1.0, math.inf), (1.0, math.nan),
                                    (0.1000001, 0.1000002)])
def test_bad_bounds_are_refused(bounds):
    with pytest.raises(ValueError, match="bad_seconds"):
        HistogramSpec("bad_seconds", "", bounds)


def test_a_value_on_a_bound_counts_in_that_bucket_and_the_buckets_are_cumulative():
    bins = Bins(SPEC.bounds)
    for value in (0.0, 0.01, 0.010001, 0.1, 5.0, 5.0):
        bins.observe(value)
    delta = bins.take()
    assert delta.buckets == (2, 4, 4, 6) and delta.count == 6
    assert delta.total == pytest.approx(10.120001)
    assert bins.take() is None  # taken: nothing left to send


def test_a_flush_costs_at_most_the_bucket_count_in_calls_however_many_observations(monkeypatch):
    registry = install(monkeypatch)
    histogram = CounterHistogram(SPEC)
    made = registry.calls  # one series per bucket, the sum and the count, made at 0
    assert made == len(SPEC.bounds) + 3 and registry.values("test_latency_seconds_count") == {(): 0.0}
    bins = Bins(SPEC.bounds)
    for _ in range(10_000):
        bins.observe(0.05)
    histogram.send(bins.take())
    # the 0.01 bucket did not change and is not sent
    assert registry.calls - made == len(SPEC.bounds) + 2


def test_the_counters_add_up_to_the_histogram_of_every_observation(monkeypatch):
    """Several flushes of random observations, two label sets: each bucket counts every value <= its bound."""
    registry = install(monkeypatch)
    histogram = CounterHistogram(SPEC, ({"replica": "0"},))
    rng = random.Random(0)
    seen: dict[str, list[float]] = {"0": [], "1": []}
    for _ in range(5):
        for replica in ("0", "1"):
            bins = Bins(SPEC.bounds)
            values = [rng.expovariate(5.0) for _ in range(rng.randrange(1, 50))]
            for value in values:
                bins.observe(value)
            seen[replica] += values
            histogram.send(bins.take(), {"replica": replica})
    for replica, values in seen.items():
        for le, bound in zip(SPEC.le_labels, (*SPEC.bounds, math.inf)):
            assert registry.value("test_latency_seconds_bucket", replica=replica, le=le) == sum(
                v <= bound for v in values)
        assert registry.value("test_latency_seconds_count", replica=replica) == len(values)
        assert registry.value("test_latency_seconds_sum", replica=replica) == pytest.approx(sum(values))


def test_the_count_is_sent_last_and_nothing_after_close(monkeypatch):
    registry = install(monkeypatch)
    histogram = CounterHistogram(SPEC)
    order = []
    for (family, labels), metric in registry.series.items():
        metric.increment = lambda value, name=family, labels=labels: order.append((name, labels))
    histogram.send(Delta((1, 1, 1, 1), 0.005, 1))
    assert order[-2:] == [("test_latency_seconds_sum", ()), ("test_latency_seconds_count", ())]
    assert [labels for name, labels in order[:-2]] == [(("le", le),) for le in SPEC.le_labels]
    histogram.close()
    calls = len(order)
    histogram.send(Delta((1, 1, 1, 1), 0.005, 1))
    assert len(order) == calls
