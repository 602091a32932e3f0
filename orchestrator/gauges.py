"""The orchestrator's gauges and cache counters, computed from its engines and the patch pool on the event loop.

The engines report each change (``Engine.on_change``: pages taken or freed, a request added or released, a step
done); :meth:`Gauges.changed` queues one update for the current pass of the event loop, however many changes the
pass makes (a step that ends 17 prompts: one update), and the update hands the values to ``Metrics``, whose thread
sends those that changed (``orchestrator.metrics``). The caches' counts are cumulative in the schedulers; their
increase since the last update goes to the ``*_total`` counters.
"""
from __future__ import annotations

import asyncio
from typing import Callable

from orchestrator.metrics import BUDGET_SCALE

_CACHE_COUNTERS = (("prefix_cache_queries", "prefix", "queried_tokens"), ("prefix_cache_hits", "prefix", "hit_tokens"),
                   ("prefix_cache_evictions", "prefix", "evictions"),
                   ("encoder_cache_queries", "encoder", "queried_tokens"),
                   ("encoder_cache_hits", "encoder", "hit_tokens"),
                   ("encoder_cache_evictions", "encoder", "evicted_tokens"))


GROWTH_WITHIN_S = 0.025  # the pages granted to growing replies show within this (metrics.GAUGE_PERIOD_S: 50 ms)


def num_waiting(engines) -> int:
    """Requests waiting for KV pages, all replicas."""
    return sum(e.scheduler.stats().num_waiting for e in engines)


class Gauges:
    """``metrics``' gauges from ``source()``: the engines (``orchestrator.engine.Engine``) and the patch pool's
    free list (``SharedPageList``) as they are now; :meth:`changed` on the event loop."""

    def __init__(self, metrics, source: Callable[[], tuple[list, object]]):
        self.metrics, self.source = metrics, source
        self._counted: dict[str, int] = {}  # the caches' counts already added to the counters
        self._due = False  # an update is queued on the event loop

    def changed(self, grew: bool = False) -> None:
        """Something the gauges show changed: update them once this pass of the event loop is done; with ``grew``
        (only KV pages granted to growing replies: a change at one decode step in every page of tokens of each
        reply, so many more follow) within :data:`GROWTH_WITHIN_S` seconds. An update already queued takes it."""
        if not self._due:
            self._due = True
            loop = asyncio.get_running_loop()
            loop.call_later(GROWTH_WITHIN_S, self.update) if grew else loop.call_soon(self.update)

    def update(self) -> None:
        """Set every gauge and add the caches' new counts, now."""
        self._due = False
        (engines, patch_pages), m = self.source(), self.metrics
        kv_free, kv_total = (sum(e.scheduler.kv_pages_free for e in engines),
                             sum(e.scheduler.kv_pages_total for e in engines))
        m.set("unifiedserve_kv_pages_free", kv_free)
        m.set("unifiedserve_kv_pages_total", kv_total)
        m.set("unifiedserve_kv_cache_usage_perc", 1 - kv_free / kv_total if kv_total else 0.0)
        m.set("unifiedserve_patch_pages_free", patch_pages.num_free)
        m.set("unifiedserve_patch_pages_total", patch_pages.num_total)
        m.set("unifiedserve_num_requests_running", sum(len(e.requests) for e in engines))
        m.set("unifiedserve_num_requests_waiting", num_waiting(engines))
        m.set("unifiedserve_requests_waiting_for_page", sum(e.scheduler.stats().num_waiting_for_page for e in engines))
        stats = {"prefix": [e.scheduler.cache_stats() for e in engines],
                 "encoder": [e.scheduler.encoder_cache.stats() for e in engines]}
        m.set("unifiedserve_prefix_cache_pages", sum(c.cached_pages for c in stats["prefix"]))
        m.set("unifiedserve_prefix_cache_idle_pages", sum(c.idle_pages for c in stats["prefix"]))
        m.set("unifiedserve_encoder_cache_tokens", sum(c.tokens for c in stats["encoder"]))
        for name, cache, attr in _CACHE_COUNTERS:
            total, counted = sum(getattr(s, attr) for s in stats[cache]), self._counted.get(name, 0)
            if total != counted:
                m.increment(f"unifiedserve_{name}_total", by=total - counted)
                self._counted[name] = total
        for e in engines:
            m.set("unifiedserve_replica_kv_pages_free", e.scheduler.kv_pages_free, e.index)
            m.set("unifiedserve_replica_kv_pages_total", e.scheduler.kv_pages_total, e.index)
            m.set("unifiedserve_replica_requests", len(e.requests), e.index)
            m.set(BUDGET_SCALE, e.policy.scale if e.policy is not None else 1.0, e.index)
            m.set("unifiedserve_replica_serving", float(e.decode_ended is None and not e.stopping), e.index)
