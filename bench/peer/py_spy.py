"""Where UnifiedServe's Python time goes during a scenario (issue 20, item 1: the 32-stream gap is in the
orchestrator, busy 85% of a core on the H200): py-spy, the sampling profiler for Python processes (``py-spy record``;
the extra wheel bundle carries it), attached to the named server processes for the scenario's length.

Each process is sampled ``RATE_HZ`` times a second without being paused (``--nonblocking``), only threads holding the
GIL (``--gil``: the time that holds up the process's event loop and its other threads), as collapsed stacks
(``--format raw``: a line a distinct stack, ``frame;frame;...;frame count``, each frame ``function (file:line)``).
:func:`top` turns them into the functions that took the most samples, on their own (self) and with their callees
(inclusive). A process py-spy cannot attach to (no binary, ptrace refused) gets its error instead; the scenario runs
regardless.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

RATE_HZ = 200
TOP = 25
STOP_TIMEOUT_S = 30.0
_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")


def binary() -> str | None:
    """The ``py-spy`` program: on PATH, or in the ``bin`` folder beside a ``sys.path`` entry (a wheel installed with
    ``pip --target``, as the H200 machine's bundles are)."""
    folders = [os.environ.get("PATH", ""), *(str(Path(p) / "bin") for p in sys.path if p)]
    return shutil.which("py-spy", path=os.pathsep.join(folders))


def frame_name(frame: str) -> str:
    """``function (file:line)`` without its line number: one name for all lines of a function."""
    match = _FRAME.match(frame)
    return f"{match['function']} ({Path(match['file']).name})" if match else frame


def top(collapsed: str, n: int = TOP) -> dict:
    """The ``n`` functions with the most samples in ``collapsed`` (py-spy's raw format), as shares of all samples:
    ``{"samples": int, "self": [[function, share], ...], "inclusive": [[function, share], ...]}``. A function that
    recurses counts once per sample in ``inclusive``."""
    own, within, samples = Counter(), Counter(), 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [frame_name(f) for f in stack.split(";")]
        samples += int(count)
        own[frames[-1]] += int(count)
        for name in set(frames):
            within[name] += int(count)

    def shares(counter: Counter) -> list[list]:
        return [[name, round(c / samples, 4)] for name, c in counter.most_common(n)] if samples else []
    return {"samples": samples, "self": shares(own), "inclusive": shares(within)}


class Profiles:
    """``with Profiles({name: pid}, folder) as p:`` records each process while the block runs; ``p.result`` is then
    ``{name: top(...)}`` or ``{name: {"error": ...}}``. The raw stacks stay in ``folder`` (``<name>.txt``).
    ``rate_hz``: samples a second; ``threads``: each stack under its thread's id (py-spy's ``--threads``)."""

    def __init__(self, processes: dict[str, int], folder: Path, rate_hz: int = RATE_HZ, threads: bool = False):
        self.processes, self.folder, self.rate_hz, self.threads = processes, folder, rate_hz, threads
        self.running: dict[str, tuple[subprocess.Popen, Path]] = {}
        self.result: dict[str, dict] = {}

    def __enter__(self) -> "Profiles":
        program = binary()
        if program is not None and self.processes:
            self.folder.mkdir(parents=True, exist_ok=True)
        for name, pid in self.processes.items():
            if program is None:
                self.result[name] = {"error": "py-spy is not installed (the extra wheel bundle carries it); looked on "
                                              "PATH and in the bin folders beside sys.path"}
                continue
            out = self.folder / f"{name}.txt"
            command = [program, "record", "--pid", str(pid), "--rate", str(self.rate_hz), "--nonblocking", "--gil",
                       "--format", "raw", *(["--threads"] if self.threads else []), "--output", str(out)]
            self.running[name] = (subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                   text=True), out)
        return self

    def __exit__(self, *exc) -> None:
        for name, (proc, out) in self.running.items():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)  # py-spy writes its output when interrupted
            try:
                log, _ = proc.communicate(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                log, _ = proc.communicate()
            if out.exists() and out.stat().st_size:
                self.result[name] = top(out.read_text())
            else:
                self.result[name] = {"error": f"py-spy exited {proc.returncode}: {log.strip()[-400:]}"}
