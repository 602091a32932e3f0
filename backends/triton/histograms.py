"""Prometheus histograms for observations made many times a second, sent to Triton as counters.

tritonserver 2.51's Python backend has ``MetricFamily.HISTOGRAM``, but each ``observe()`` is one round trip from
the stub to the Triton process, taken again for every observation (``bench/RESULTS.md``, "custom metric
update"): a histogram of inter-token latency or of decode steps would cost one round trip per response or per
step. Here observations are binned in the process (:class:`Bins`, no Triton call) and sent
(:class:`CounterHistogram`) as counter increments: at most ``len(bounds) + 3`` calls per series and flush,
whatever the number of observations. The series are the ones a Prometheus histogram has:
``NAME_bucket{le="..."}`` (cumulative; the last ``le="+Inf"`` equals the count), ``NAME_sum`` and
``NAME_count``, so PromQL's ``rate`` and ``histogram_quantile`` read them as they read a native histogram. Only
the ``# TYPE`` lines differ: each of the three families says ``counter``.
"""
from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass

from backends.triton import triton_io

SUFFIXES = {"_bucket": "histogram buckets: the observations <= le", "_sum": "histogram: the observations' sum",
            "_count": "histogram: the number of observations"}


def le_label(bound: float) -> str:
    """A bucket bound as Prometheus clients write its ``le`` label: ``0.5`` -> "0.5", ``1.0`` -> "1",
    ``60`` -> "60", infinity -> "+Inf"."""
    return "+Inf" if bound == math.inf else f"{bound:g}"


@dataclass(frozen=True)
class HistogramSpec:
    """A histogram's ``name`` (without suffix, its unit last: ``_seconds``, ``_tokens``), its ``help`` text and the
    upper ``bounds`` of its buckets in that unit (finite, strictly increasing; the ``+Inf`` bucket is implied).

    Raises ValueError for bounds that are empty, not finite, not increasing, or that print alike."""

    name: str
    help: str
    bounds: tuple[float, ...]

    def __post_init__(self):
        if not self.bounds or not all(math.isfinite(b) for b in self.bounds):
            raise ValueError(f"{self.name}: bucket bounds must be finite numbers, got {self.bounds!r}")
        if any(a >= b for a, b in zip(self.bounds, self.bounds[1:])):
            raise ValueError(f"{self.name}: bucket bounds must increase, got {self.bounds!r}")
        if len(set(self.le_labels)) != len(self.le_labels):
            raise ValueError(f"{self.name}: bucket bounds {self.bounds!r} print alike as le labels")

    @property
    def le_labels(self) -> tuple[str, ...]:
        """The ``le`` label of each bucket, ``"+Inf"`` last."""
        return (*map(le_label, self.bounds), "+Inf")


@dataclass(frozen=True)
class Delta:
    """What a series gained since its last flush: ``buckets[i]``, the observations <= bound i (cumulative, one per
    ``le`` label, ``+Inf`` last), their sum ``total`` (the histogram's unit) and their ``count``."""

    buckets: tuple[int, ...]
    total: float
    count: int


class Bins:
    """One series' observations since the last :meth:`take`, binned by ``bounds`` (a HistogramSpec's). Not
    thread-safe: callers that observe on one thread and take on another hold their own lock."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is (last bound, +Inf)
        self._total = 0.0

    def observe(self, value: float) -> None:
        """Count ``value`` (the histogram's unit) in the first bucket whose bound is >= it (Prometheus' ``le``)."""
        self._counts[bisect.bisect_left(self.bounds, value)] += 1
        self._total += value

    def take(self) -> Delta | None:
        """The observations since the last take as a Delta, and forget them; None when there were none."""
        count = sum(self._counts)
        if not count:
            return None
        delta = Delta(tuple(itertools.accumulate(self._counts)), self._total, count)
        self._counts, self._total = [0] * len(self._counts), 0.0
        return delta


class CounterHistogram:
    """``spec``'s three counter families in the Triton process (made in a model's ``initialize``), with a series per
    label set: those of ``label_sets`` from the start at 0 (so that ``rate`` sees their first increment), others on
    their first :meth:`send`. Each call here is a round trip to Triton: send from a thread that may wait."""

    def __init__(self, spec: HistogramSpec, label_sets: tuple[dict[str, str], ...] = ({},)):
        pb = triton_io.pb()
        self.spec = spec
        # Families must outlive their metrics, so both are kept.
        self._families = [pb.MetricFamily(spec.name + suffix, f"{spec.help} ({what})", pb.MetricFamily.COUNTER)
                          for suffix, what in SUFFIXES.items()]
        self._series: dict[tuple, list] = {}  # label items -> [bucket metrics..., sum metric, count metric]
        for labels in label_sets:
            self._get(labels)

    def _get(self, labels: dict[str, str]) -> list:
        key = tuple(sorted(labels.items()))
        if key not in self._series:
            buckets, total, count = self._families
            self._series[key] = [*(buckets.Metric(labels={**labels, "le": le}) for le in self.spec.le_labels),
                                 total.Metric(labels=labels), count.Metric(labels=labels)]
        return self._series[key]

    def send(self, delta: Delta, labels: dict[str, str] | None = None) -> None:
        """Add ``delta`` to the series of ``labels``: the buckets in order, then the sum, then the count, so that a
        scrape that shows the new count shows every bucket increment under it. Nothing after :meth:`close`."""
        if not self._families:
            return
        *buckets, total, count = self._get(labels or {})
        for metric, n in zip(buckets, delta.buckets):
            if n:
                metric.increment(n)
        total.increment(delta.total)
        count.increment(delta.count)

    def close(self) -> None:
        """For ``finalize``: drop the series, then the families (metrics alive when the stub exits crash it,
        triton-inference-server/server#8662); later sends do nothing."""
        self._series, self._families = {}, []
