"""A server's Python-backend stub processes: which are alive, their threads' stacks, and a watch for one dying.

Each model instance of the Python backend runs in a stub process (``triton_python_backend_stub``) of
tritonserver's process group; its command line names the ``model.py`` it runs, and so the model.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from backends.triton.server_stop import MARKER

if TYPE_CHECKING:
    from backends.triton.launcher import TritonServer


def _live_stubs(group: int) -> list[tuple[int, list[bytes]]]:
    """(pid, command line) of the stub processes of process group ``group`` (a tritonserver's pid) that are alive. A
    stub killed from outside stays a zombie of tritonserver, left out here."""
    alive = []
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            pid = int(comm.parent.name)
            if not comm.read_text().strip().startswith("triton_python") or os.getpgid(pid) != group:
                continue
            state = (comm.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
            argv = (comm.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):  # gone
            continue
        if state not in ("Z", "X") and len(argv) > 2:  # an exiting process's command line is empty
            alive.append((pid, argv))
    return alive


def stub_processes(group: int) -> dict[int, str]:
    """The stub processes of process group ``group`` that are alive: pid -> model (the name of the folder of the
    model.py it runs, its first argument)."""
    return {pid: Path(argv[1].decode(errors="replace")).parent.parent.name for pid, argv in _live_stubs(group)}


def stub_regions(group: int) -> set[str]:
    """The Python backend's shared-memory regions (names in /dev/shm) of the live stubs of process group ``group``:
    each stub's second argument. Triton removes them when it exits; when it is killed they stay, and their names do
    not say whose they are, so the launcher notes them while the server runs."""
    prefix = b"triton_python_backend_shm_region_"
    return {argv[2].decode(errors="replace") for _, argv in _live_stubs(group) if argv[2].startswith(prefix)}


def dump_stacks(stubs: dict[int, str], wait_s: float = 2.0, note: Callable[[str], None] | None = None) -> None:
    """SIGUSR1 to each stub of ``stubs`` (pid -> model), one at a time: each writes all its threads' stacks to the
    server log (the models turn on faulthandler for that signal), ``note(line)`` (if given) first writing a line that
    names the model and pid; ``wait_s`` seconds in all are shared between them, so that their stacks do not
    interleave (all at once, four processes' stacks came out mixed line by line)."""
    for pid, model in stubs.items():
        if note is not None:
            note(f"--- stacks of model {model} (stub pid {pid}) ---")
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGUSR1)
        time.sleep(wait_s / len(stubs))


def watch_stages(server: "TritonServer", companion: Callable[[], str | None] | None = None,
                 period_s: float = 1.0) -> str | None:
    """Wait while ``server`` runs; return why it must stop when a model's stub process that was there when it became
    ready has died (killed, or out of memory), when ``companion`` (a check of a process serving beside it, such as
    the OpenAI API's :meth:`~backends.openai.process.ApiProcess.exit_reason`) returns why that one ended, or, once the
    server has exited, why it died (a signal, an error status: :func:`crashed`); None when it exited cleanly or was
    stopped from elsewhere. Triton 2.51 keeps a model whose stub died READY and fails its requests ("Stub process
    ... is not healthy") without restarting it, so the server is stopped instead, for a supervisor (systemd,
    Kubernetes) to start a fresh one; a server whose API died is stopped for the same supervisor."""
    stopping = server.run_dir / MARKER  # a stop from elsewhere is announced there before the models unload
    while server.process.poll() is None:
        if (dead := dead_stub(server)) and server.process.poll() is None and not stopping.exists():
            return dead
        if companion is not None and (why := companion()):
            return why
        time.sleep(period_s)
    return None if stopping.exists() else crashed(server.process.returncode)


def dead_stub(server: "TritonServer") -> str | None:
    """"the process of model NAME has died" when a stub process that was there when ``server`` became ready is gone
    (counted per model, so one of two instances too), else None."""
    missing = Counter(server.ready_stubs.values()) - Counter(server.stubs().values())
    return f"the process of model {', '.join(sorted(missing))} has died" if missing else None


def crashed(status: int | None, who: str = "tritonserver") -> str | None:
    """What ended a process (``who``) that exited without being asked (``status``: its ``returncode``; negative, the
    signal), or None for a clean exit (status 0)."""
    if not status:
        return None
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"{who} was killed by {signal.Signals(-status).name}"
        return f"{who} was killed by signal {-status}"
    return f"{who} exited by itself with status {status}"
