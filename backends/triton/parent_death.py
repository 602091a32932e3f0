"""Processes that end with the launcher that started them: Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``,
man 2 prctl), set in the child between its fork and its exec.

tritonserver and the OpenAI API run in sessions of their own (Ctrl-C reaches the launcher alone, which stops them in
order), so a launcher killed with SIGKILL (an OOM kill, a supervisor's last resort) left both running: the API
answering 503 for ever on its port and the server holding its ports and GPU memory, so the supervisor's restart
failed on a port that was not free. With this they get SIGTERM when the launcher dies, which stops each as a
signal from elsewhere does. The signal follows the thread that started the child, so only the launcher's command
line (its main thread) asks for it.
"""
from __future__ import annotations

import ctypes
import signal
import sys
from typing import Callable

_PR_SET_PDEATHSIG = 1
# resolved here, before any fork: the child between fork and exec only makes the call
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def ends_with_parent(sig: signal.Signals = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` that has the child sent ``sig`` when this process (the thread that
    starts it) dies; None off Linux."""
    if _prctl is None:
        return None
    number = int(sig)
    return lambda: _prctl(_PR_SET_PDEATHSIG, number)
