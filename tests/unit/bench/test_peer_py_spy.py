"""bench/peer/py_spy.py: py-spy's collapsed stacks read into the functions that took the most samples; a process is
recorded while a block runs, or its error is kept (the scenario runs regardless)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from bench.peer import py_spy

COLLAPSED = """\
<module> (loop.py:3);run (loop.py:10);step (engine.py:40);decode (detok.py:7) 6
<module> (loop.py:3);run (loop.py:10);step (engine.py:41) 3
<module> (loop.py:3);run (loop.py:11);send (lanes.py:5) 1
not a stack line
"""


def test_top_gives_self_and_inclusive_shares_per_function_whatever_its_lines():
    result = py_spy.top(COLLAPSED)
    assert result["samples"] == 10
    assert result["self"] == [["decode (detok.py)", 0.6], ["step (engine.py)", 0.3], ["send (lanes.py)", 0.1]]
    inclusive = dict(map(tuple, result["inclusive"]))
    assert inclusive["run (loop.py)"] == 1.0 and inclusive["step (engine.py)"] == 0.9
    assert py_spy.top("") == {"samples": 0, "self": [], "inclusive": []}


def test_without_py_spy_each_process_gets_the_error_and_the_block_still_runs(monkeypatch, tmp_path):
    monkeypatch.setattr(py_spy, "binary", lambda: None)
    ran = []
    with py_spy.Profiles({"orchestrator": 1}, tmp_path) as profiles:
        ran.append(True)
    assert ran and "not installed" in profiles.result["orchestrator"]["error"]


@pytest.mark.skipif(py_spy.binary() is None, reason="needs the py-spy program (the extra wheel bundle carries it)")
def test_a_busy_process_is_recorded_where_it_spends_its_time(tmp_path):
    busy = subprocess.Popen([sys.executable, "-c", "def spin():\n while True: sum(range(1000))\nspin()"])
    try:
        with py_spy.Profiles({"busy": busy.pid}, tmp_path) as profiles:
            subprocess.run([sys.executable, "-c", "import time; time.sleep(1.5)"], check=True)
    finally:
        busy.kill()
    result = profiles.result["busy"]
    assert result["samples"] > 50, result
    assert dict(map(tuple, result["inclusive"]))["spin (<string>)"] > 0.9, result
