"""The decode loop's pacing (``backends.ipc.protocol.DecodePace``): while it lasts, step launches are spaced at
least an interval apart, so an encode/prefill step beside them gets more of the GPU. A pacing ends when the
orchestrator ends it or, at the latest, when its time is up."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pacing:
    """Launches at least ``interval_s`` apart until ``until`` (time.perf_counter() seconds); the default: none."""

    interval_s: float = 0.0
    until: float = 0.0

    @classmethod
    def starting(cls, interval_ms: float, for_ms: float, now: float) -> "Pacing":
        """A pacing of ``interval_ms`` (ms; 0 or less: none) from ``now`` for ``for_ms`` (ms)."""
        if interval_ms <= 0 or for_ms <= 0:
            return cls()
        return cls(interval_ms / 1e3, now + for_ms / 1e3)

    def wait_s(self, last_launch: float, now: float) -> float:
        """Seconds from ``now`` until the next step may be launched, the last one launched at ``last_launch``
        (time.perf_counter() seconds); 0: at once."""
        if now >= self.until:
            return 0.0
        return max(0.0, min(last_launch + self.interval_s, self.until) - now)
