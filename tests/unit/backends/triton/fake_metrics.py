"""The custom-metric part of ``triton_python_backend_utils`` (``MetricFamily``, its ``Metric``s) in memory, for unit
tests of the code that builds and sends metrics; it records every call, as each is a round trip to Triton in the
real stub. End-to-end tests read the real ones on ``/metrics``."""
from __future__ import annotations

import sys
import types


class FakeMetric:
    def __init__(self, registry: "Registry", family: str, kind: int, labels: dict[str, str]):
        self.registry, self.family, self.kind, self.labels, self.value = registry, family, kind, labels, 0.0

    def increment(self, value: float) -> None:
        assert self.kind == FakeMetricFamily.COUNTER and value >= 0, (self.family, value)
        self.registry.calls += 1
        self.value += value

    def set(self, value: float) -> None:
        assert self.kind == FakeMetricFamily.GAUGE, self.family
        self.registry.calls += 1
        self.value = value


class FakeMetricFamily:
    COUNTER, GAUGE, HISTOGRAM = 0, 1, 2
    registry: "Registry"

    def __init__(self, name: str, description: str, kind: int):
        self.name, self.description, self.kind = name, description, kind
        self.registry.families[name] = self

    def Metric(self, labels: dict[str, str] | None = None) -> FakeMetric:  # noqa: N802 (the stub's name)
        key = (self.name, tuple(sorted((labels or {}).items())))
        assert key not in self.registry.series, f"series {key} made twice"
        self.registry.calls += 1
        metric = self.registry.series[key] = FakeMetric(self.registry, self.name, self.kind, dict(labels or {}))
        return metric


class Registry:
    """Every family and series made, and the number of calls (round trips) so far."""

    def __init__(self):
        self.families: dict[str, FakeMetricFamily] = {}
        self.series: dict[tuple[str, tuple], FakeMetric] = {}
        self.calls = 0

    def value(self, family: str, **labels: str) -> float:
        return self.series[(family, tuple(sorted(labels.items())))].value

    def values(self, family: str) -> dict[tuple, float]:
        """{sorted label items: value} of ``family``'s series."""
        return {labels: m.value for (name, labels), m in self.series.items() if name == family}


def install(monkeypatch) -> Registry:
    """Make ``triton_python_backend_utils`` importable as this fake for the test; returns its registry."""
    registry = Registry()
    family = type("MetricFamily", (FakeMetricFamily,), {"registry": registry})
    module = types.ModuleType("triton_python_backend_utils")
    module.MetricFamily = family
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", module)
    return registry
