"""Where a request's time goes in the OpenAI API process, joined to the orchestrator's timeline
(``return_timeline``, orchestrator/timeline.py).

The orchestrator's timeline counts ms from the request's arrival there and gives that moment as
``arrived_monotonic_s`` (``time.monotonic()``); the API process runs beside tritonserver on the same host, so its own
moments convert to the same scale: ``api_received`` (the route began; negative), ``api_sent`` (the request handed to
the gRPC stream), ``api_first_response`` (the orchestrator's first response read back) and ``api_first_chunk`` (the
first streamed chunk made). They show the time outside the orchestrator: the hops before it and after it. Per token
(the timeline's ``tokens``, in µs as the orchestrator's lists), ``api_chunk_us``: when the streamed chunk that
brought it was made, once per token.
"""
from __future__ import annotations

import time

import numpy as np

from orchestrator.timeline import Timeline


class ApiMarks:
    """One request's moments in this process, from its start (``api_received``); ``per_token``: the chunks' times
    too (a request with ``return_timeline``, whose responses carry their output ids), else :meth:`chunk` records
    nothing."""

    def __init__(self, per_token: bool = False):
        self._marks: list[tuple[str, float]] = [("api_received", time.monotonic())]
        self._per_token = per_token
        self._chunks: list[float] = []  # per token, when the chunk bringing it was made

    def mark(self, event: str) -> None:
        """Record ``event`` now."""
        self._marks.append((event, time.monotonic()))

    def chunk(self, tokens: int) -> None:
        """A streamed chunk bringing ``tokens`` tokens is made now (recorded with ``per_token``)."""
        if self._per_token:
            self._chunks += [time.monotonic()] * tokens

    def into(self, timeline: dict | None) -> dict | None:
        """``timeline`` (the orchestrator's JSON object) with these moments among its events, all in ms since the
        orchestrator's arrival, in time order, and the chunks' times in its ``tokens``; unchanged when it is None or
        gives no ``arrived_monotonic_s``."""
        if not timeline or "arrived_monotonic_s" not in timeline:
            return timeline
        scale = Timeline(timeline["arrived_monotonic_s"])
        ours = [{"ms": scale.ms(at), "event": event} for event, at in self._marks]
        joined = {**timeline, "events": sorted([*ours, *timeline.get("events", ())], key=lambda e: e["ms"])}
        if self._chunks:
            chunks = scale.us(np.asarray(self._chunks)[None, :])[0]
            joined["tokens"] = {**timeline.get("tokens", {}), "api_chunk_us": chunks}
        return joined
