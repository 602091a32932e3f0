"""A model's process that outlives its tritonserver is ended, and the server's files with it.

Triton 2.51 exits without unloading its models when its exit timeout runs out, and before it unloads anything it
waits that long for HTTP clients to close their connections (an idle keep-alive connection is enough: "Found 1 HTTP
service connections", then "Exit timeout expired. Exiting immediately."). Its stubs then notice ("Non-graceful
termination detected"), but one with requests in flight may never end: a fresh operator's try (2026-12-06) found the
orchestrator's stub at 10-20% CPU and decode's holding 872 MB for over a minute under PID 1, deaf to SIGTERM, and the
server's pools left in /dev/shm; tests/e2e/test_ops.py left flashcodec's stub so. A thread of the stub's own cannot
help: such a stub does not run its Python threads any more.

So each model forks a watchdog (:func:`watch`) when it loads: a process of its own that looks, every
:data:`PERIOD_S`, whether the model's process still runs and still has its tritonserver as parent. When the model's
process ends, the watchdog ends. When the server has gone, the watchdog gives the model's process :data:`GRACE_S`
to end by itself, then kills it (SIGKILL), sweeps the server's files (``stale_shm``: its pools, lock and run
directory go once no process of the server holds its lock; the Python backend's regions once no tritonserver runs
here) and ends. The launcher ends a dead server's model processes itself (docs/operations.md); whichever comes first
does it.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from backends.triton.stale_shm import remove_stale_shared_memory

GRACE_S = 5.0  # s a model's process gets to end by itself once its tritonserver has gone
PERIOD_S = 1.0  # s between two looks
SWEEPS = 16  # sweeps of /dev/shm, 0.5 s apart, once the server has gone (beyond the other models' grace)
NAME = "unifiedserve-wd"  # the watchdog's process name (at most 15 characters)


def _parent_of(pid: int) -> int | None:
    """The parent of process ``pid``, None when it has ended (a zombie included)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[1])


def watch(period_s: float = PERIOD_S, grace_s: float = GRACE_S) -> int:
    """Fork this model process's watchdog (module docstring); returns its pid. Call it before the model takes the
    server's lock (``standalone.adopt``), which the watchdog would otherwise hold too. The watchdog runs no thread,
    takes no lock that a thread of this process could hold at the fork (no logging, no import) and ends with
    ``os._exit``."""
    model, server = os.getpid(), os.getppid()
    child = os.fork()
    if child:
        return child
    try:
        Path("/proc/self/comm").write_text(NAME)  # not a stub to whoever counts them by name (backends.triton.stubs)
        while (parent := _parent_of(model)) == server:
            time.sleep(period_s)
        if parent is not None:  # the model's process lives on without its server
            deadline = time.monotonic() + grace_s
            while _parent_of(model) is not None and time.monotonic() < deadline:
                time.sleep(0.1)
            if _parent_of(model) is not None:
                os.kill(model, signal.SIGKILL)
        if _parent_of(server) is None:  # the server has gone, not this model alone (unloaded): its files go
            for _ in range(SWEEPS):  # the last of its model processes may end a little after this one
                time.sleep(0.5)
                remove_stale_shared_memory()
    finally:
        os._exit(0)
