"""PhaseClock (backends/runtime/phase_clock.py) on the CPU: each phase's duration, in order."""
import time

import torch

from backends.runtime.phase_clock import PhaseClock


def test_phases_are_timed_in_order():
    clock = PhaseClock(torch.device("cpu"))
    time.sleep(0.02)
    before = time.perf_counter()
    clock.mark()
    clock.mark()  # an empty phase
    around_ms = (time.perf_counter() - before) * 1e3
    time.sleep(0.01)
    clock.mark()
    first, empty, last = clock.phases_ms()
    # the empty phase is no longer than the time around its marks (a fixed bound would fail whenever the process is
    # paused between them: a garbage collection, another process on the CPU)
    assert first >= 20 and 0 <= empty <= around_ms and last >= 10
