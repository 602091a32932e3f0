"""PhaseClock (backends/runtime/phase_clock.py) on the CPU: each phase's duration, in order."""
import time

import torch

from backends.runtime.phase_clock import PhaseClock


def test_phases_are_timed_in_order():
    clock = PhaseClock(torch.device("cpu"))
    time.sleep(0.02)
    clock.mark()
    clock.mark()  # an empty phase
    time.sleep(0.01)
    clock.mark()
    first, empty, last = clock.phases_ms()
    assert first >= 20 and 0 <= empty < 5 and last >= 10
