"""The run directory of a server started without the launcher: ``tritonserver --model-repository=...`` alone (the
NGC image's entrypoint, a Helm chart, a rendered repository).

The launcher makes a run directory per server and names it in ``UNIFIEDSERVE_RUN_DIR`` (``backends.ipc.run_dir``).
Without it, every model process of one server derives the same directory from the server itself: each model
instance is a Python-backend stub process started by the tritonserver process (its parent), so
``<tmp>/unifiedserve-run-t<pid>_<start>_<ns>`` names it, from that process's pid, its start time (clock ticks since
boot) and its pid namespace: a restarted server, or another container's server with the same pid (often 1), gets
another. :func:`adopt` exports the name, so the model's helper processes inherit it as they would the launcher's.

The directory is made on demand and lives while a model of the server does: each model process holds a shared
flock on the server's lock file (``stale_shm.lock_path``, which the launchers' sweeps test: files of a live server
are never swept), and the last one to let go removes the directory and the server's /dev/shm files. Media folders
stay opt-in (``UNIFIEDSERVE_MEDIA_DIRS`` or the orchestrator's ``allowed_media_dirs``); a stop is Triton's own
(requests in flight run on until ``--exit-timeout-secs``), since no launcher drains the models first
(``backends.triton.server_stop``: its markers work the same in this directory).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import MutableMapping

from backends.ipc.run_dir import RUN_DIR_ENV
from backends.triton.stale_shm import lock_path, remove_run_files, remove_stale_shared_memory
from flashcodec.parallel import TMP_PREFIX_ENV


def server_run_name(server_pid: int) -> str:
    """The run directory's name for the tritonserver process ``server_pid`` (as seen from this process's pid
    namespace). Raises OSError when that process is gone."""
    # /proc/PID/stat: the fields after the command's closing parenthesis start at field 3; starttime is field 22.
    start = (Path(f"/proc/{server_pid}/stat").read_text().rsplit(")", 1)[1].split())[19]
    namespace = os.stat("/proc/self/ns/pid").st_ino
    return f"unifiedserve-run-t{server_pid}_{start}_{namespace}"


class StandaloneRunDir:
    """This model process's hold on its server's run directory (see the module docstring).

    ``path``: the directory; :meth:`release` (once, when the model unloads or fails to load) lets go of the lock
    and, when no other model process of the server holds it, removes the directory and the server's /dev/shm files.
    """

    def __init__(self, path: Path):
        self.path = path
        self._lock = _shared_lock(lock_path(path.name))

    def release(self) -> None:
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another model of this server still runs: it removes them
            self._lock.close()
            return
        # Removed while held: a model process that opens the lock file now waits, then sees it unlinked (_shared_lock).
        shutil.rmtree(self.path, ignore_errors=True)
        remove_run_files(self.path.name)  # the pools' files, the flashcodec temporary files and the lock
        self._lock.close()


def _shared_lock(path: Path):
    """``path`` opened and share-locked (blocking), retried while the file found was unlinked by a last holder."""
    while True:
        lock = open(path, "ab")
        fcntl.flock(lock, fcntl.LOCK_SH)
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino:
                return lock
        lock.close()


def adopt(environ: MutableMapping[str, str] = os.environ) -> StandaloneRunDir | None:
    """For a model's ``initialize``: None when the launcher named the run directory (``UNIFIEDSERVE_RUN_DIR`` is
    set); else this server's run directory (created, mode 0700), held until :meth:`StandaloneRunDir.release`, and
    named in ``environ`` (``UNIFIEDSERVE_RUN_DIR``, and the prefix of flashcodec's temporary files, so that they go
    with the pools). Files that servers gone before left in /dev/shm are removed first (``stale_shm``).
    Raises OSError when the parent process is no longer there."""
    if environ.get(RUN_DIR_ENV):
        return None
    path = Path(tempfile.gettempdir()) / server_run_name(os.getppid())
    remove_stale_shared_memory()
    held = StandaloneRunDir(path)
    path.mkdir(mode=0o700, exist_ok=True)
    environ[RUN_DIR_ENV] = str(path)
    environ[TMP_PREFIX_ENV] = f"unifiedserve-{path.name}-flashcodec-"
    return held
