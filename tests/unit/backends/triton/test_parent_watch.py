"""A model's watchdog (backends/triton/parent_watch.py), with real processes: a model process that outlives its
server is killed after its grace; one that ends takes its watchdog with it; neither counts as a stub."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from backends.triton.parent_watch import NAME, _parent_of

REPO_ROOT = Path(__file__).resolve().parents[4]
# the "model": forks its watchdog, prints both pids, then lives on (or ends after LIFE_S)
MODEL = ("import sys, time; from backends.triton import parent_watch; "
         "print(parent_watch.watch(period_s=0.1, grace_s=0.5), flush=True); time.sleep(float(sys.argv[1]))")
# the "server": starts the model, prints its pid, lives SERVER_S, ends
SERVER = ("import subprocess, sys, time; model = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]]); "
          "print(model.pid, flush=True); time.sleep(float(sys.argv[3]))")


def _run(model_life_s: float, server_life_s: float) -> tuple[int, int]:
    """(the model's pid, its watchdog's), the server having started the model (the server prints the model's pid
    first: the model has Python to start before it prints its watchdog's)."""
    server = subprocess.Popen([sys.executable, "-c", SERVER, MODEL, str(model_life_s), str(server_life_s)],
                              stdout=subprocess.PIPE, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    return int(server.stdout.readline()), int(server.stdout.readline())


def _ends(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _parent_of(pid) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    return _parent_of(pid) is None


def test_a_model_process_that_outlives_its_server_is_killed_after_its_grace():
    model, watchdog = _run(model_life_s=60, server_life_s=1)
    deadline = time.monotonic() + 5
    while Path(f"/proc/{watchdog}/comm").read_text().strip() != NAME and time.monotonic() < deadline:
        time.sleep(0.02)
    assert Path(f"/proc/{watchdog}/comm").read_text().strip() == NAME  # not "triton_python...": no stub
    assert _parent_of(model) is not None
    assert _ends(model, timeout_s=10) and _ends(watchdog, timeout_s=15)


def test_a_model_process_that_ends_takes_its_watchdog_with_it():
    model, watchdog = _run(model_life_s=1, server_life_s=30)
    assert _ends(model, timeout_s=10) and _ends(watchdog, timeout_s=5)
