"""A server's files in /dev/shm, and the sweep that removes those of servers that are gone.

A server's files there are ``unifiedserve-<run>-<pool>`` (``backends.ipc.shared_tensor``) and its lock
``unifiedserve-<run>.lock``, ``<run>`` being its run directory's name (``tempfile.mkdtemp``: ``unifiedserve-run-``
and ``[a-z0-9_]``). The lock is an flock held by the server and its launcher, which holds across containers that
share /dev/shm (``--ipc=host``), so another launcher's sweep can tell a live server's files from a dead one's.
"""
from __future__ import annotations

import fcntl
import re
import shutil
import tempfile
import time
from pathlib import Path

SHM = Path("/dev/shm")
STALE_RUN_DIR_S = 60.0  # a run directory without a lock is left alone this long (its launcher may be taking one)
_RUN_FILE = re.compile(r"^unifiedserve-(unifiedserve-run-[a-z0-9_]+)[-.]")


def lock_path(run: str) -> Path:
    """The lock file of the server whose run directory is named ``run``."""
    return SHM / f"unifiedserve-{run}.lock"


def lock_held(lock: Path) -> bool:
    """Whether a server holds ``lock`` (an flock, which holds across containers that share /dev/shm)."""
    try:
        with open(lock, "rb") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def remove_run_files(run: str) -> None:
    """Remove the pools and the lock of the server whose run directory is named ``run``."""
    for path in SHM.glob(f"unifiedserve-{run}[-.]*"):
        path.unlink(missing_ok=True)


def _tritonserver_running() -> bool:
    for status in Path("/proc").glob("[0-9]*/comm"):
        try:
            if status.read_text().strip() == "tritonserver":
                return True
        except OSError:
            continue
    return False


def remove_stale_shared_memory() -> list[Path]:
    """Remove the files of servers that are gone: Python-backend shm regions and UnifiedServe pools.

    A server's pools go once its lock (``unifiedserve-<run>.lock``, held by it and its launcher) is free, and with
    them its run directory (``<tmp>/<run>``, which a killed launcher leaves; its log ``<tmp>/<run>.log`` is kept);
    pools without a lock, run directories without one (older than ``STALE_RUN_DIR_S``), and the Python backend's
    regions (whose names do not say whose they are), only when no tritonserver runs here at all. So a live server's
    files are never touched, also one in another container sharing /dev/shm (``--ipc=host``). Returns the removed
    paths.
    """
    alone = not _tritonserver_running()
    stale = [*SHM.glob("triton_python_backend_shm_region_*")] if alone else []
    runs: dict[str, list[Path]] = {}
    run_dirs = []
    for path in SHM.glob("unifiedserve-*"):
        if match := _RUN_FILE.match(path.name):
            runs.setdefault(match.group(1), []).append(path)
        elif alone:
            stale.append(path)
    for run, paths in runs.items():
        lock = lock_path(run)
        if (alone and not lock.exists()) or (lock.exists() and not lock_held(lock)):
            stale += paths
            run_dir = Path(tempfile.gettempdir()) / run
            if run_dir.is_dir():
                run_dirs.append(run_dir)
    if alone:  # run directories whose lock is gone (an earlier sweep took it): no server of theirs is left
        for folder in Path(tempfile.gettempdir()).glob("unifiedserve-run-*"):
            try:  # not one a launcher made a moment ago, before taking its lock
                idle_s = time.time() - folder.stat().st_mtime
            except OSError:  # gone meanwhile
                continue
            if folder.is_dir() and folder not in run_dirs and idle_s > STALE_RUN_DIR_S and not lock_path(
                    folder.name).exists():
                run_dirs.append(folder)
    for path in stale:
        path.unlink(missing_ok=True)
    for folder in run_dirs:
        shutil.rmtree(folder, ignore_errors=True)
    return stale + run_dirs
