"""How long consecutive phases of a step's work took on its device: CUDA events on a GPU (the device's own time,
read once it has run them), the host's clock on the CPU (where the work runs as it is called)."""
from __future__ import annotations

import time

import torch


class PhaseClock:
    """Started at construction; :meth:`mark` ends a phase; :meth:`phases_ms` gives each phase's duration (ms)."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        self._marks = [self._now()]

    def _now(self):
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream: after the work queued so far
        return event

    def mark(self) -> None:
        self._marks.append(self._now())

    def phases_ms(self) -> list[float]:
        """The phases' durations in ms, in order. On a GPU this waits until the device has run the last phase."""
        if not self._cuda:
            return [(b - a) * 1e3 for a, b in zip(self._marks, self._marks[1:])]
        self._marks[-1].synchronize()
        return [a.elapsed_time(b) for a, b in zip(self._marks, self._marks[1:])]
