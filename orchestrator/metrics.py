"""UnifiedServe's Prometheus metrics, served on Triton's metrics port next to Triton's own.

Free-page gauges make leaks visible (docs/design.md, invariant 2): at idle they equal the totals.
"""
from __future__ import annotations

from backends.triton import triton_io

GAUGES = {
    "unifiedserve_kv_pages_free": "KV pages not held by any request",
    "unifiedserve_kv_pages_total": "KV pages in the pool",
    "unifiedserve_patch_pages_free": "patch pages not held by any request",
    "unifiedserve_patch_pages_total": "patch pages in the pool",
    "unifiedserve_patch_pages_peak_last_request": "most patch pages the last finished request with media held at "
                                                  "once (taken as groups are decoded, returned as they are encoded)",
    "unifiedserve_requests_running": "requests in the server and not finished (those waiting for KV pages too)",
    "unifiedserve_requests_waiting": "requests not yet granted their KV pages (prompt + max_tokens, reserved at "
                                     "admission)",
}
# per replica of encode_prefill + decode (label "replica"); the unlabelled gauges above are their sums
REPLICA_GAUGES = {
    "unifiedserve_replica_kv_pages_free": "KV pages of the replica's pool not held by any request",
    "unifiedserve_replica_kv_pages_total": "KV pages in the replica's pool",
    "unifiedserve_replica_requests": "requests on the replica (admitted, not yet released)",
}
COUNTERS = {
    "unifiedserve_requests_finished": "requests that ended, by finish_reason (stop, length, abort; invalid: refused "
                                      "as bad input; error: failed in the server)",
    "unifiedserve_scheduler_steps": "encode+prefill steps executed",
}


class Metrics:
    """Creates the metric families once (the orchestrator's initialize, with its number of ``replicas``) and
    updates them."""

    def __init__(self, replicas: int = 1):
        pb = triton_io.pb()
        # A family must outlive its metrics, so both are kept.
        self._gauge_families = {n: pb.MetricFamily(n, d, pb.MetricFamily.GAUGE)
                                for n, d in {**GAUGES, **REPLICA_GAUGES}.items()}
        self._gauges = {n: self._gauge_families[n].Metric() for n in GAUGES}
        self._gauges.update({(n, k): self._gauge_families[n].Metric(labels={"replica": str(k)})
                             for n in REPLICA_GAUGES for k in range(replicas)})
        self._counter_families = {n: pb.MetricFamily(n, d, pb.MetricFamily.COUNTER) for n, d in COUNTERS.items()}
        self._counters: dict[tuple[str, str], object] = {}
        self._values: dict = {}  # the last value set per gauge: each set is a round trip to Triton, skip repeats

    def set(self, name: str, value: float, replica: int | None = None) -> None:
        """Set gauge ``name`` (of REPLICA_GAUGES: ``replica``'s series)."""
        key = name if replica is None else (name, replica)
        if self._gauges and self._values.get(key) != value:
            self._gauges[key].set(value)
            self._values[key] = value

    def increment(self, name: str, label: str = "", by: float = 1) -> None:
        if not self._counter_families:
            return
        key = (name, label)
        if key not in self._counters:
            labels = {"finish_reason": label} if label else {}
            self._counters[key] = self._counter_families[name].Metric(labels=labels)
        self._counters[key].increment(by)

    def close(self) -> None:
        """For ``finalize``: drop every metric and family (later updates do nothing). Metrics still alive
        when the stub exits crash it (triton-inference-server/server#8662)."""
        self._counters, self._gauges = {}, {}
        self._counter_families, self._gauge_families = {}, {}
