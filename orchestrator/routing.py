"""Which replica's engine a new request goes to (``backends.triton.replicas``: each replica has its own KV pool,
so its own scheduler; the patch pool, one flashcodec, is shared). A request lives on one replica from
admission to release: its KV pages are in that replica's pool, which only that replica's stages map."""
from __future__ import annotations

from typing import Sequence

from orchestrator.engine import Engine


def choose(engines: Sequence[Engine], prompt_tokens: int, max_tokens: int) -> Engine | None:
    """The engine for a request of ``prompt_tokens`` + ``max_tokens`` tokens: among those whose decode stream is
    alive and whose pool can hold the request at all, one whose scheduler would admit it at once
    (``Scheduler.admits_now``) if any, then the fewest requests, the most free KV pages, the lowest index; None
    when there is none. A lone engine that fits is the answer without the rest: ``admits_now`` goes over every
    request in its scheduler, on each arrival (5% of the orchestrator's GIL while a 32-request burst is admitted,
    py-spy on the CPU machine)."""
    fit = [e for e in engines if e.decode_ended is None
           and e.scheduler.kv_pages_for(prompt_tokens + max_tokens) <= e.scheduler.kv_pages_total]
    if len(fit) == 1:
        return fit[0]
    return min(fit, key=lambda e: (not e.scheduler.admits_now(prompt_tokens, max_tokens), len(e.requests),
                                   -e.scheduler.kv_pages_free, e.index), default=None)
