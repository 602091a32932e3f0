"""The prefix-cache counters of both systems (issue 21), read from their Prometheus metrics around a scenario.

Both count prompt tokens: ``queries`` the tokens looked up in the prefix cache, ``hits`` those found there.

* vLLM 0.26: the counters ``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits`` (``vllm/v1/metrics/loggers.py``;
  prometheus_client exposes a counter with ``_total`` added), one series per engine, on its API's ``/metrics``; they
  stay at 0 with ``--no-enable-prefix-caching`` (its scheduler then looks nothing up).
* UnifiedServe: ``unifiedserve_prefix_cache_queries_total`` and ``unifiedserve_prefix_cache_hits_total`` on Triton's
  metrics port (where ``bench.serve_bench.read_metrics`` reads its other metrics).

A server whose metrics lack them (UnifiedServe before its prefix cache) reads as None, and so does its scenario.
"""
from __future__ import annotations

import urllib.request

from bench.peer.servers import metrics_port

COUNTERS = {"unifiedserve": ("unifiedserve_prefix_cache_queries_total", "unifiedserve_prefix_cache_hits_total"),
            "vllm": ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")}


def metrics_url(record: dict) -> str:
    """The Prometheus endpoint of the server of state ``record`` (``bench.peer.servers``): UnifiedServe's Triton
    metrics port, else its API's own ``/metrics`` (vLLM's)."""
    port = metrics_port(record)
    return f"http://127.0.0.1:{port}/metrics" if port else f"{record['url']}/metrics"


def parse(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Each metric of ``names`` in the Prometheus text ``text``, summed over its label sets; absent ones left out."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in names:
            values[name] = values.get(name, 0.0) + float(line.split()[-1])
    return values


def read(system: str, record: dict) -> dict[str, float] | None:
    """``{"queries": tokens, "hits": tokens}`` of ``system``'s running server (its state ``record``) now; None when
    its metrics lack either counter."""
    with urllib.request.urlopen(metrics_url(record), timeout=10) as response:
        values = parse(response.read().decode(), COUNTERS[system])
    if len(values) < 2:
        return None
    queries, hits = COUNTERS[system]
    return {"queries": values[queries], "hits": values[hits]}


def increase(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """Each counter's increase from ``before`` to ``after`` (tokens); None when either is."""
    if before is None or after is None:
        return None
    return {key: after[key] - before[key] for key in after}
