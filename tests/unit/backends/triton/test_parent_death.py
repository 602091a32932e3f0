"""Processes that end with their launcher (backends/triton/parent_death.py): a child started with the preexec hook,
in a session of its own, is sent SIGTERM when the process that started it is killed."""
import os
import signal
import subprocess
import sys
import time

import pytest

from backends.triton.launcher import REPO_ROOT
from tests.processes import running

STARTER = """
import subprocess, sys
from backends.triton.parent_death import ends_with_parent
child = subprocess.Popen(["sleep", "60"], start_new_session=True, preexec_fn=ends_with_parent())
print(child.pid, flush=True)
sys.stdin.read()  # until killed
"""


@pytest.mark.skipif(sys.platform != "linux", reason="Linux's prctl")
def test_the_child_is_stopped_when_its_starter_is_killed():
    starter = subprocess.Popen([sys.executable, "-c", STARTER], cwd=REPO_ROOT, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    child = int(starter.stdout.readline())
    try:
        os.kill(child, 0)  # running
        starter.send_signal(signal.SIGKILL)
        starter.wait()
        deadline = time.monotonic() + 10
        while running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(child)
    finally:
        if running(child):
            os.kill(child, signal.SIGKILL)

