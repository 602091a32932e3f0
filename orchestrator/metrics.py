"""UnifiedServe's Prometheus metrics, served on Triton's metrics port next to Triton's own.

Names and kinds follow vLLM's (``vllm:time_to_first_token_seconds`` -> ``unifiedserve_time_to_first_token_seconds``):
latency histograms in seconds, ``_total`` counters, KV-cache usage as a fraction. Free-page gauges make leaks
visible (docs/design.md, invariant 2): at idle they equal the totals.

Every update is a round trip to the Triton process, and a gauge's holds the GIL until Triton answers (the 2.51
stub's ``Metric.set``), so none is made on the event loop, and the thread that sends them lets go of the GIL after
each gauge (``triton_io.yield_gil``). A gauge set there is recorded here and sent soon by the
metrics thread, which wakes for it and sends the gauges that changed since its last send, at most every
``GAUGE_PERIOD_S`` seconds (a burst of changes costs one send per gauge); on 2 CPU cores, 32 text requests
arriving at once spent about a fifth of the orchestrator's GIL time in gauge sets made on the loop, and with the
thread sending every 5 ms still 9% (py-spy, 2026-12-04), hence 50 ms. Counter
increments and histogram observations are summed and binned here, under a lock and without a Triton call, and
the same thread sends them once a second (``backends.triton.histograms``: a histogram costs at most its bucket
count per flush, whatever the load).
"""
from __future__ import annotations

import threading
import time

from backends.triton import triton_io
from backends.triton.histograms import Bins, CounterHistogram, HistogramSpec
from orchestrator.engine_io import Released

FLUSH_S = 1.0  # seconds between sends of the counters and histograms (a scrape lags by at most this)
GAUGE_PERIOD_S = 0.05  # least seconds between two sends of changed gauges (a scrape comes seconds apart)

GAUGES = {
    "unifiedserve_kv_pages_free": "KV pages a request may be granted (free, or idle in the prefix cache above its "
                                  "floor)",
    "unifiedserve_kv_pages_total": "KV pages in the pool, less the prefix cache's floor",
    "unifiedserve_kv_cache_usage_perc": "fraction (0 to 1) of the KV pages held by requests, all replicas together",
    "unifiedserve_patch_pages_free": "patch pages not held by any request",
    "unifiedserve_patch_pages_total": "patch pages in the pool",
    "unifiedserve_patch_pages_peak_last_request": "most patch pages the last finished request with media held at "
                                                  "once (taken as groups are decoded, returned as they are encoded)",
    "unifiedserve_num_requests_running": "requests in the server and not finished (those waiting for KV pages too)",
    "unifiedserve_requests_waiting_for_page": "requests in decode whose next token waits for a KV page (granted where "
                                              "every request could still reach its max_tokens)",
    "unifiedserve_num_requests_waiting": "requests not yet admitted: their prompt's KV pages not granted (a request is "
                                     "admitted where every request could still reach its max_tokens)",
    "unifiedserve_prefix_cache_pages": "KV pages in the prefix cache (held by requests or idle), all replicas",
    "unifiedserve_prefix_cache_idle_pages": "prefix-cache pages no request holds (evicted first when pages are "
                                            "needed), all replicas",
    "unifiedserve_encoder_cache_tokens": "visual tokens whose embeddings the encoder cache keeps, all replicas",
}
BUDGET_SCALE = "unifiedserve_replica_budget_scale"
SERVING = "unifiedserve_replica_serving"  # the OpenAI API's /health reads it too (backends/openai/replica_health.py)
# per replica of encode_prefill + decode (label "replica"); the unlabelled gauges above are their sums
REPLICA_GAUGES = {
    "unifiedserve_replica_kv_pages_free": "KV pages of the replica's pool a request may be granted (free, or idle in "
                                          "its prefix cache above the floor)",
    "unifiedserve_replica_kv_pages_total": "KV pages in the replica's pool, less the prefix cache's floor",
    "unifiedserve_replica_requests": "requests on the replica (admitted, not yet released)",
    BUDGET_SCALE: "the factor of the replica's encode and prefill budgets this step "
                                         "(SLO scheduling; 1 without it)",
    SERVING: "1 while the replica serves (its engine starts once the orchestrator is loaded); 0 once its decode "
             "stream or step loop has ended (its requests failed; new ones go to other replicas, or fail naming why) "
             "or the server stops (a stage unloaded alone included)",
}
SUCCESS = "unifiedserve_request_success_total"
FINISHED_REASONS = ("stop", "length", "abort", "invalid", "overloaded", "error")  # invalid: refused as bad input;
# overloaded: refused for the load (max_waiting_requests); error: failed
COUNTERS = {
    SUCCESS: "requests that ended, by finished_reason (stop, length, abort; invalid: refused as bad input; "
             "overloaded: refused for the load; error: failed in the server)",
    "unifiedserve_prompt_tokens_total": "prompt tokens (text and visual) of the requests that got a first token",
    "unifiedserve_generation_tokens_total": "tokens generated and handed to the clients' responses",
    "unifiedserve_scheduler_steps_total": "encode+prefill steps executed",
    "unifiedserve_decode_paced_steps_total": "encode+prefill steps during which decode's launches were spaced "
                                             "(decode_pace_ms) or held (hold_joins)",
    "unifiedserve_prefix_cache_queries_total": "prompt tokens of the requests granted KV pages (looked up in the "
                                               "prefix cache)",
    "unifiedserve_prefix_cache_hits_total": "prompt tokens found in the prefix cache (not computed again)",
    "unifiedserve_prefix_cache_evictions_total": "KV pages evicted from the prefix cache",
    "unifiedserve_encoder_cache_queries_total": "visual tokens of media groups looked up in the encoder cache",
    "unifiedserve_encoder_cache_hits_total": "visual tokens whose embeddings came from the encoder cache (their "
                                             "group neither decoded nor encoded)",
    "unifiedserve_encoder_cache_evictions_total": "visual tokens evicted from the encoder cache",
}
TTFT = "unifiedserve_time_to_first_token_seconds"
ITL = "unifiedserve_inter_token_latency_seconds"
E2E = "unifiedserve_e2e_request_latency_seconds"
QUEUE = "unifiedserve_request_queue_time_seconds"
PREFILL = "unifiedserve_request_prefill_time_seconds"
DECODE = "unifiedserve_request_decode_time_seconds"
VISUAL = "unifiedserve_request_visual_tokens"
_LONG = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 240.0, 480.0)  # whole requests
HISTOGRAMS = {spec.name: spec for spec in (
    HistogramSpec(TTFT, "seconds from a request's arrival to its first token handed to the client's response",
                  (0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                   60.0)),
    HistogramSpec(ITL, "seconds between a request's consecutive outputs handed to the client (one observation per "
                       "output; an output carries the tokens that arrived since the last)",
                  (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                   0.2, 0.3, 0.5, 0.75, 1.0)),
    HistogramSpec(E2E, "seconds from a request's arrival to its last output (requests that ended stop, length or "
                       "abort)", _LONG),
    HistogramSpec(QUEUE, "seconds from a request's admission to the first scheduler step with work for it (waiting "
                         "for KV pages and for its first media group)",
                  (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0)),
    HistogramSpec(PREFILL, "seconds from a request's first scheduler step to its first token (media decoding, "
                           "vision encoding and prefill)",
                  (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0)),
    HistogramSpec(DECODE, "seconds from a request's first token to its last", _LONG),
    HistogramSpec(VISUAL, "visual tokens in a request's prompt (0 for text alone)",
                  (0.0, 64.0, 256.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0, 65536.0, 131072.0)),
)}


class Metrics:
    """Creates the metric families once (the orchestrator's initialize, with its number of ``replicas``, whose
    ``unifiedserve_replica_serving`` it sets to 1 before it returns); its own thread sends the gauges that changed
    soon after they change (at most every ``gauge_period_s`` seconds) and the counters and histograms every
    ``flush_s`` seconds."""

    def __init__(self, replicas: int = 1, flush_s: float = FLUSH_S, gauge_period_s: float = GAUGE_PERIOD_S):
        pb = triton_io.pb()
        # A family must outlive its metrics, so both are kept.
        self._gauge_families = {n: pb.MetricFamily(n, d, pb.MetricFamily.GAUGE)
                                for n, d in {**GAUGES, **REPLICA_GAUGES}.items()}
        self._gauges = {n: self._gauge_families[n].Metric() for n in GAUGES}
        self._gauges.update({(n, k): self._gauge_families[n].Metric(labels={"replica": str(k)})
                             for n in REPLICA_GAUGES for k in range(replicas)})
        self._values: dict = {}  # the last value set per gauge (the event loop's view)
        self._changed: dict = {}  # gauge -> value set since the thread's last send (under _lock)
        self._sent: dict = {}  # gauge -> the value Triton has (the thread's): a repeat is not sent
        self._counter_families = {n: pb.MetricFamily(n, d, pb.MetricFamily.COUNTER) for n, d in COUNTERS.items()}
        self._counters: dict[tuple[str, str], object] = {}
        for key in [*((n, "") for n in COUNTERS if n != SUCCESS), *((SUCCESS, r) for r in FINISHED_REASONS)]:
            self._counter(*key)  # every series from 0, so that rate() sees its first increment
        self._histograms = {n: CounterHistogram(spec) for n, spec in HISTOGRAMS.items()}
        self._lock = threading.Lock()  # guards the pending sums and bins (the event loop adds, the thread takes)
        self._pending: dict[tuple[str, str], float] = {}
        self._bins = {n: Bins(spec.bounds) for n, spec in HISTOGRAMS.items()}
        self._flush_s, self._gauge_period_s = flush_s, gauge_period_s
        self._closed = threading.Event()
        self._gauges_changed = threading.Event()  # wakes the thread
        self._send_lock = threading.Lock()  # one send of gauges at a time (the thread's or a flush's), in order
        for k in range(replicas):  # a new gauge reads 0 until the first request starts the engines: 0 would say
            self.set(SERVING, 1.0, k)  # "ended" (/health's 503), and a budget factor of 0 none that is ever applied
            self.set(BUDGET_SCALE, 1.0, k)
        self.send_gauges()  # now: before Triton reports the orchestrator READY
        self._thread = threading.Thread(target=self._run, name="orchestrator-metrics", daemon=True)
        self._thread.start()

    def set(self, name: str, value: float, replica: int | None = None) -> None:
        """Set gauge ``name`` (of REPLICA_GAUGES: ``replica``'s series) to ``value``: sent by the metrics thread
        within about ``gauge_period_s`` seconds, if it changed."""
        key = name if replica is None else (name, replica)
        if self._values.get(key) == value:
            return
        self._values[key] = value
        with self._lock:
            self._changed[key] = value
        self._gauges_changed.set()

    def increment(self, name: str, label: str = "", by: float = 1) -> None:
        """Add ``by`` to counter ``name`` (``label``: the ``finished_reason`` of SUCCESS), sent with the next flush."""
        with self._lock:
            self._pending[(name, label)] = self._pending.get((name, label), 0) + by

    def observe(self, name: str, value: float) -> None:
        """Observe ``value`` (the unit its name gives) in histogram ``name``, sent with the next flush."""
        with self._lock:
            self._bins[name].observe(value)

    def flush(self) -> None:
        """Send what was added since the last flush (the metrics thread's job; at close, after it ended); nothing
        once closed."""
        if not self._counter_families:
            return
        self.send_gauges()
        with self._lock:
            pending, self._pending = self._pending, {}
            deltas = [(n, d) for n, bins in self._bins.items() if (d := bins.take()) is not None]
        for (name, label), by in pending.items():
            self._counter(name, label).increment(by)
        for name, delta in deltas:
            self._histograms[name].send(delta)

    def _counter(self, name: str, label: str):
        if (name, label) not in self._counters:
            labels = {"finished_reason": label} if label else {}
            self._counters[(name, label)] = self._counter_families[name].Metric(labels=labels)
        return self._counters[(name, label)]

    def send_gauges(self) -> None:
        """Send the gauges set since the last send whose value Triton does not have yet (the metrics thread's job;
        ``flush`` does it too)."""
        with self._send_lock:
            with self._lock:
                changed, self._changed = self._changed, {}
            for key, value in changed.items():
                if self._gauges and self._sent.get(key) != value:
                    self._gauges[key].set(value)
                    self._sent[key] = value
                    triton_io.yield_gil()

    def _run(self) -> None:
        next_flush = time.monotonic() + self._flush_s
        while not self._closed.is_set():
            if self._gauges_changed.wait(max(0.0, next_flush - time.monotonic())):
                self._gauges_changed.clear()
                self.send_gauges()
                self._closed.wait(self._gauge_period_s)  # changes made meanwhile wait for the next send
            if time.monotonic() >= next_flush:
                self.flush()
                next_flush = time.monotonic() + self._flush_s

    def close(self) -> None:
        """For ``finalize``: stop the thread, send what is pending, drop every metric and family (later updates
        are not sent). Metrics still alive when the stub exits crash it (triton-inference-server/server#8662)."""
        self._closed.set()
        self._gauges_changed.set()
        self._thread.join(timeout=10)
        self.flush()
        for histogram in self._histograms.values():
            histogram.close()
        self._counters, self._gauges = {}, {}
        self._counter_families, self._gauge_families = {}, {}


class RequestTimer:
    """One client request's metrics as its outputs leave: time to first token, the gap before each later output,
    end-to-end latency (from ``arrived``, ``time.monotonic()`` seconds, when Triton handed it over), its tokens and
    how it finished. Each call only adds to ``metrics``' pending sums."""

    def __init__(self, metrics: Metrics, arrived: float):
        self.metrics, self.arrived = metrics, arrived
        self.prompt_tokens = 0
        self.last_output: float | None = None
        self.counted = True  # False: not a generation (tokenize_only, a token channel's opening), nothing counted

    def admitted(self, prompt_tokens: int, visual_tokens: int) -> None:
        """The request runs: ``prompt_tokens`` in its prompt, ``visual_tokens`` of them for its media."""
        self.prompt_tokens = prompt_tokens
        self.metrics.observe(VISUAL, visual_tokens)

    def output(self, tokens: int, now: float | None = None) -> None:
        """An output with ``tokens`` new tokens (at least one) is handed to the client's response at ``now``
        (default: the current ``time.monotonic()``)."""
        now = time.monotonic() if now is None else now
        if self.last_output is None:
            self.metrics.observe(TTFT, now - self.arrived)
            self.metrics.increment("unifiedserve_prompt_tokens_total", by=self.prompt_tokens)
        else:
            self.metrics.observe(ITL, now - self.last_output)
        self.last_output = now
        self.metrics.increment("unifiedserve_generation_tokens_total", by=tokens)

    def finished(self, reason: str, now: float | None = None) -> None:
        """The request ended with ``reason`` (FINISHED_REASONS); the latency of those served (stop, length, abort)."""
        if not self.counted:
            return
        self.metrics.increment(SUCCESS, reason)
        if reason not in ("invalid", "error", "overloaded"):
            self.metrics.observe(E2E, (time.monotonic() if now is None else now) - self.arrived)


def observe_engine_times(metrics: Metrics, released: Released) -> None:
    """A request's time in the engine, as it leaves it: its queue time once a step had work for it, its prefill
    and decode times once it had a first token (all in seconds)."""
    if released.scheduled:
        metrics.observe(QUEUE, released.scheduled - released.admitted)
    if released.first_token:
        metrics.observe(PREFILL, released.first_token - released.scheduled)
        metrics.observe(DECODE, released.last_token - released.first_token)
