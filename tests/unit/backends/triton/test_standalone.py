"""The run directory of a server started without the launcher (backends/triton/standalone.py): every model process
of one server finds the same one, shares its token, keeps it from other launchers' sweeps while one of them lives,
and the last to let go removes it with the server's /dev/shm files. The model processes are played by child
processes of this test (their parent standing for tritonserver)."""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from backends.ipc.run_dir import RUN_DIR_ENV
from backends.triton import standalone
from backends.triton.launcher import REPO_ROOT
from backends.triton.stale_shm import SHM, lock_held, lock_path, remove_stale_shared_memory

MODEL = r"""
import os, sys
from backends.triton import standalone
held = standalone.adopt()
from backends.triton.internal_token import internal_token
print(os.environ["UNIFIEDSERVE_RUN_DIR"], internal_token(), os.environ["FLASHCODEC_TMP_PREFIX"], flush=True)
sys.stdin.readline()
held.release()
print("released", flush=True)
"""


def start_model() -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in (RUN_DIR_ENV, "FLASHCODEC_TMP_PREFIX")}
    return subprocess.Popen([sys.executable, "-c", MODEL], cwd=REPO_ROOT, env={**env, "PYTHONPATH": str(REPO_ROOT)},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def release(model: subprocess.Popen) -> None:
    model.stdin.write("\n")
    model.stdin.flush()
    assert model.stdout.readline().strip() == "released"
    assert model.wait(30) == 0


def test_the_name_comes_from_the_server_process():
    name = standalone.server_run_name(os.getpid())
    assert name == standalone.server_run_name(os.getpid())  # every model process of one server agrees
    assert name.startswith(f"unifiedserve-run-t{os.getpid()}_") and name.endswith(
        f"_{os.stat('/proc/self/ns/pid').st_ino}")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert standalone.server_run_name(other.pid) != name
    finally:
        other.kill()
        other.wait()
    with pytest.raises(OSError):
        standalone.server_run_name(other.pid)  # gone


def test_the_launchers_run_directory_wins():
    environ = {RUN_DIR_ENV: "/tmp/unifiedserve-run-abc"}
    assert standalone.adopt(environ) is None
    assert environ == {RUN_DIR_ENV: "/tmp/unifiedserve-run-abc"}


def test_models_of_one_server_share_the_directory_and_the_last_one_out_removes_it():
    run = standalone.server_run_name(os.getpid())
    path = Path(tempfile.gettempdir()) / run
    first, second = start_model(), start_model()
    try:
        answers = [model.stdout.readline().split() for model in (first, second)]
        assert answers[0] == answers[1] == [str(path), answers[0][1], f"unifiedserve-{run}-flashcodec-"]
        assert len(answers[0][1]) == 32  # one token for both: a stage link made by one is open to the other
        assert path.is_dir() and (path / "internal.token").stat().st_mode & 0o777 == 0o600
        pool = SHM / f"unifiedserve-{run}-kv_pool"
        pool.write_bytes(b"x")  # as decode's CPU pool
        assert lock_held(lock_path(run))
        remove_stale_shared_memory()  # another launcher starting meanwhile: a live server's files stay
        assert pool.exists() and path.is_dir()
        release(first)
        assert pool.exists() and path.is_dir()  # the second model still runs
        release(second)
        assert not pool.exists() and not path.exists() and not lock_path(run).exists()
    finally:
        for model in (first, second):
            model.kill()
            model.wait()
