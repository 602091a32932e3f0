"""A request's timeline: where its time goes, from arrival to its last response, for benchmarks (``return_timeline``).

Events are recorded in the orchestrator as they happen, in ms since the request arrived (``time.monotonic()``):
``parsed``, ``probed`` (every media item's metadata read), ``prompt_built`` (tokens), ``engine_added`` (its
media decodes start), ``group_ready`` (a temporal-patch group decoded into patch pages by flashcodec), ``step``
(one encode_prefill step with work of this request: when it was launched, its groups and prefill tokens, and the
worker's own time), ``first_token``, ``decode_admitted``, ``last_token``, ``first_response`` and
``final_response`` (its response built). Beside the events, each token's way out (``tokens``, in whole µs since
arrival): for every token from decode, when its step was launched on the decode stage, when the stage read it and
when it arrived here (a stop string may end the reply before the last tokens decode made, which are recorded all the
same); for every streamed response with tokens but the one with the timeline, when Triton's send of it returned on
its send lane, once per token it brought (on a token channel the timeline trails the last tokens:
``orchestrator.frontend``). Compared with the client's arrival times, they say at which hop a gap between tokens
opened (``bench/peer/timelines.py``). A request without the flag gets :data:`NO_TIMELINE`, which records nothing.

The per-token lists are integers, converted with numpy: a 256-token reply's timeline took 0.48 ms of the
orchestrator's GIL to write with its lists as ms floats (Python's float formatting: about 0.2 µs a number), 0.14 ms
with µs integers (the CPU machine). The requests of a burst end in the same decode step, and on an H100 (2026-12-06,
32 text streams) the 17 timelines written together held up the other streams' last tokens 11 ms where they reached
the orchestrator and 10 ms more to their send: the TBT p99's largest gaps after the burst's first ones
(bench/results/peer/nineteenth-run-h100-2026-12-06/README.md).
"""
from __future__ import annotations

import json
import time
from typing import Callable

import numpy as np

from backends.ipc.protocol import StepPlan, StepResult

# a timeline's per-token lists (µs since arrival): decode's launch and read of the token's step and its arrival in
# the orchestrator (tokens from decode: all but the first), then the send of the response that brought it
TOKEN_MOMENTS = ("decode_launched_us", "decode_read_us", "received_us", "sent_us")

class Timeline:
    """The events of one request that arrived at ``arrived`` (``time.monotonic()`` seconds)."""

    def __init__(self, arrived: float):
        self.arrived = arrived
        self.events: list[tuple[float, str, dict]] = []
        # per token, as time.monotonic() seconds: made into ms only when read (a decode step's tokens pass here)
        self._decoded: list[tuple[float, float, float]] = []
        self._sent: list[tuple[float, int]] = []

    def ms(self, at: float) -> float:
        """``at`` (``time.monotonic()`` seconds) in ms since arrival, to the microsecond."""
        return round((at - self.arrived) * 1e3, 3)

    def mark(self, event: str, at: float | None = None, **fields) -> None:
        """Record ``event`` at ``at`` (default: now) with its ``fields`` (JSON values)."""
        self.events.append((self.ms(time.monotonic() if at is None else at), event, fields))

    def decoded(self, launched_s: float, read_s: float, received_s: float) -> None:
        """One token from decode: its step's launch and read on the decode stage (``DecodeStep``; 0.0: not
        measured, recorded as None) and its arrival in the orchestrator (``time.monotonic()`` seconds)."""
        self._decoded.append((launched_s, read_s, received_s))

    def sent(self, count: int) -> None:
        """Triton's send of a response bringing ``count`` tokens has just returned (called from its send lane)."""
        self._sent.append((time.monotonic(), count))

    def us(self, moments: np.ndarray) -> list[list[int | None]]:
        """Each row of ``moments`` (``time.monotonic()`` seconds; 0.0: not measured) in whole µs since arrival (None
        where not measured), converted as one array (module docstring)."""
        out = np.rint((moments - self.arrived) * 1e6).astype(np.int64).tolist()
        if not moments.all():
            out = [[None if not t else u for t, u in zip(row, us)] for row, us in zip(moments.tolist(), out)]
        return out

    @property
    def tokens(self) -> dict[str, list[int | None]]:
        """The per-token lists of :data:`TOKEN_MOMENTS`, µs since arrival (None: not measured)."""
        decoded, sent = list(self._decoded), list(self._sent)  # copies: the loop and the lanes may still append
        sent_at = np.repeat([at for at, _ in sent], [count for _, count in sent]) if sent else np.empty(0)
        # launched, read, received per token from decode; sent per token handed to Triton
        rows = self.us(np.asarray(decoded, dtype=np.float64).reshape(-1, 3).T) + self.us(sent_at[None, :])
        return dict(zip(TOKEN_MOMENTS, rows))

    def to_json(self) -> str:
        """``{"arrived_monotonic_s": ..., "events": [{"ms": ..., "event": ..., **fields}, ...], "tokens": {...}}``,
        events in the order recorded, ``tokens`` the per-token lists (:data:`TOKEN_MOMENTS`) that have entries (none:
        no ``tokens``); ``arrived_monotonic_s``, the arrival as ``time.monotonic()`` seconds, places other processes'
        moments on the same host on this scale (the OpenAI API's: ``backends.openai.timing``)."""
        tokens = {name: at for name, at in self.tokens.items() if at}
        return json.dumps({"arrived_monotonic_s": round(self.arrived, 6),
                           "events": [{"ms": ms, "event": event, **fields} for ms, event, fields in self.events],
                           **({"tokens": tokens} if tokens else {})})


class _NoTimeline(Timeline):
    def mark(self, event: str, at: float | None = None, **fields) -> None:
        pass

    def decoded(self, launched_s: float, read_s: float, received_s: float) -> None:
        pass

    def sent(self, count: int) -> None:
        pass


NO_TIMELINE = _NoTimeline(0.0)


def mark_steps(plan: StepPlan, timeline_of: Callable[[str], Timeline], launched: float, result: StepResult) -> None:
    """A ``step`` event on the timeline (``timeline_of(req_id)``) of each request with work in ``plan``: when it was
    launched (``time.monotonic()`` seconds), the request's groups and patches encoded and prompt tokens prefilled in
    it, and from ``result`` the worker's time for the whole step and, where measured, the device's time for its
    encode and its prefill (ms)."""
    work: dict[str, list[int]] = {}  # req_id -> [groups, patches, prefill tokens]
    for encode in plan.encode:
        counts = work.setdefault(encode.req_id, [0, 0, 0])
        counts[0] += 1
        counts[1] += encode.num_patches
    for prefill in plan.prefill:
        work.setdefault(prefill.req_id, [0, 0, 0])[2] += prefill.end - prefill.start
    device = {name: round(ms, 3) for name, ms in (("encode_ms", result.encode_ms), ("prefill_ms", result.prefill_ms))
              if ms is not None}
    for req_id, (groups, patches, tokens) in work.items():
        timeline = timeline_of(req_id)
        timeline.mark("step", launched_ms=timeline.ms(launched), encode_groups=groups, encode_patches=patches,
                      prefill_tokens=tokens, worker_ms=round(result.worker_ms, 3), **device)
