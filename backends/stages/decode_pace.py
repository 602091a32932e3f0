"""The decode loop's pacing (``backends.ipc.protocol.DecodePace``): while it lasts, step launches are spaced at
least an interval apart, so an encode/prefill step beside them gets more of the GPU. A pacing ends when the
orchestrator ends it or, at the latest, when its time is up. A pacing of interval 0 spaces nothing but runs the steps
one at a time (:meth:`Pacing.serial`): each is read before the next is launched, so a sequence admitted meanwhile
joins the very next launch instead of the one after a step already queued (``orchestrator.decode_pace.joins_decode``).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pacing:
    """Launches at least ``interval_s`` apart, each step read before the next is launched, until ``until``
    (time.perf_counter() seconds); the default: none."""

    interval_s: float = 0.0
    until: float = 0.0

    @classmethod
    def starting(cls, interval_ms: float, for_ms: float, now: float) -> "Pacing":
        """A pacing of ``interval_ms`` (ms; 0 or less: steps one at a time, none spaced) from ``now`` for ``for_ms``
        (ms; 0 or less: none)."""
        if for_ms <= 0:
            return cls()
        return cls(max(0.0, interval_ms) / 1e3, now + for_ms / 1e3)

    def serial(self, now: float) -> bool:
        """Whether steps run one at a time at ``now`` (time.perf_counter() seconds): a pacing lasts."""
        return now < self.until

    def wait_s(self, last_launch: float, now: float) -> float:
        """Seconds from ``now`` until the next step may be launched, the last one launched at ``last_launch``
        (time.perf_counter() seconds); 0: at once."""
        if now >= self.until:
            return 0.0
        return max(0.0, min(last_launch + self.interval_s, self.until) - now)
