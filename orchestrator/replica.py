"""One replica of the encode+prefill and decode stages as the orchestrator drives it (``backends/triton/replicas.py``),
and the choice of replica for a new request.

A replica has its own KV pool, so its own page table and scheduler; the patch pool (one flashcodec) is shared.
A request lives on one replica from admission to release: its KV pages are in that replica's pool, which only
that replica's stages map. Routing prefers a replica that can start the request now (its scheduler would grant
its KV pages at the next step), then goes by load: the fewest requests, then the most free KV pages, then the
lowest index.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Sequence

from backends.triton.replicas import replica_name
from orchestrator.pages import PageAllocator
from orchestrator.scheduler import Scheduler


@dataclass
class Replica:
    """Replica ``index``: its stages' model names, its KV page table (``kv_page_size`` tokens a page) and
    scheduler, and its step loop's state. ``requests``: admitted and not yet released."""

    index: int
    kv_pages: PageAllocator
    scheduler: Scheduler
    kv_page_size: int
    requests: int = 0
    registered: set[str] = field(default_factory=set)  # requests the encode_prefill stage knows
    released: list[str] = field(default_factory=list)  # requests it should forget at its next step
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    decode_ended: str | None = None  # why this replica's decode stream has ended, once it has

    @property
    def encode_prefill(self) -> str:
        return replica_name("encode_prefill", self.index)

    @property
    def decode(self) -> str:
        return replica_name("decode", self.index)


def choose(replicas: Sequence[Replica], kv_needed: int) -> Replica | None:
    """The replica a request needing ``kv_needed`` KV pages goes to: among those whose decode stream is alive and
    whose pool can hold the request at all, one that would admit it at once (``Scheduler.admits_now``) if any,
    then the fewest requests, the most free KV pages, the lowest index; None when there is none."""
    fit = [r for r in replicas if r.decode_ended is None and kv_needed <= r.kv_pages.num_total]
    return min(fit, key=lambda r: (not r.scheduler.admits_now(kv_needed), r.requests, -r.kv_pages.num_free, r.index),
               default=None)
