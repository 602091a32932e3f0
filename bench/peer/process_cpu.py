"""The CPU time of UnifiedServe's processes over a scenario: which one is busy while the clients wait (issue 20,
item 1). Read from Linux's ``/proc/<pid>/stat`` (``utime`` + ``stime``, fields 14 and 15 in proc(5), in clock ticks).

The processes: the launcher's children ``tritonserver`` and ``openai_api`` (the OpenAI API's process and its uvicorn
workers, counted together), and each Python-backend stub by its model (``backends.triton.stubs.stub_processes``).
Helper processes of a stage (GOP workers, NVDEC helpers) are not counted.
"""
from __future__ import annotations

import os
from pathlib import Path

from backends.triton.stubs import stub_processes

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far; None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S  # utime, stime: the 14th and 15th fields


def children(parent: int) -> dict[int, tuple[str, bytes]]:
    """pid -> (command name, command line) of the live children of process ``parent``."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            comm, rest = stat.read_text().split(" (", 1)[1].rsplit(")", 1)
            if int(rest.split()[1]) == parent:  # the parent's pid, the 4th field
                found[int(stat.parent.name)] = (comm, (stat.parent / "cmdline").read_bytes())
        except (OSError, ValueError, IndexError):
            continue
    return found


def server_processes(launcher_pid: int) -> dict[str, tuple[int, ...]]:
    """Name -> pids of the processes of the server that launcher ``launcher_pid`` runs (the module docstring)."""
    found: dict[str, tuple[int, ...]] = {}
    for pid, (comm, argv) in children(launcher_pid).items():
        if comm == "tritonserver":
            found["tritonserver"] = (pid,)
            found.update({model: (stub,) for stub, model in stub_processes(pid).items()})
        elif b"backends.openai" in argv:
            found["openai_api"] = (pid, *children(pid))
    return found


def snapshot(launcher_pid: int) -> dict[str, float]:
    """CPU seconds so far of each of the server's processes (name -> seconds, summed over its pids)."""
    out = {}
    for name, pids in server_processes(launcher_pid).items():
        seconds = [s for pid in pids if (s := cpu_seconds(pid)) is not None]
        if seconds:
            out[name] = sum(seconds)
    return out


def busy(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
    """Each process's CPU time between two snapshots as a share of ``wall_s`` (1.0: one core all the time)."""
    return {name: round((after[name] - before[name]) / wall_s, 3) for name in sorted(after) if name in before}
