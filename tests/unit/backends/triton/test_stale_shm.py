"""Stale shared-memory files: a server's pools are removed only once its lock is free, so a live server's
files survive another launcher's sweep, also across containers that share /dev/shm."""
import fcntl
import shutil
import tempfile
import uuid
from pathlib import Path

from backends.triton.stale_shm import SHM, remove_stale_shared_memory


def run_files(run: str) -> list:
    paths = [SHM / f"unifiedserve-{run}-{name}" for name in ("kv_pool", "flashcodec-0a1b")]
    paths.append(SHM / f"unifiedserve-{run}.lock")
    for path in paths:
        path.write_bytes(b"x")
    return paths


def run_dir(run: str) -> tuple[Path, Path]:
    """A run directory with a file in it, and its log beside it, as the launcher makes them."""
    folder = Path(tempfile.gettempdir()) / run
    (folder / "repository").mkdir(parents=True)
    (folder / "repository" / "config.pbtxt").write_text("x")
    log = folder.with_suffix(".log")
    log.write_text("the server's log")
    return folder, log


def test_a_held_run_is_kept_and_a_free_one_removed():
    live, gone = (f"unifiedserve-run-{uuid.uuid4().hex[:8]}" for _ in range(2))
    live_files, gone_files = run_files(live), run_files(gone)
    (live_dir, live_log), (gone_dir, gone_log) = run_dir(live), run_dir(gone)
    with open(live_files[-1], "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as the live server's launcher holds it
        try:
            removed = remove_stale_shared_memory()
            assert all(path.exists() for path in live_files) and live_dir.is_dir()
            assert not any(path.exists() for path in gone_files) and set(gone_files) <= set(removed)
            assert not gone_dir.exists() and gone_dir in removed
            assert gone_log.read_text() == "the server's log"  # a killed server's log stays for its user
        finally:
            for path in [*live_files, live_log, gone_log]:
                path.unlink(missing_ok=True)
            shutil.rmtree(live_dir, ignore_errors=True)


def test_a_run_directory_whose_lock_is_gone_is_removed_when_no_server_runs(monkeypatch, tmp_path):
    """Left by runs killed before the sweep removed run directories: their locks went with an earlier sweep.
    (Private /dev/shm and temp folders: with "no server running" faked, the sweep must not see real ones.)"""
    import os
    import time

    from backends.triton import stale_shm

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(stale_shm, "SHM", tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    old, new = (f"unifiedserve-run-{uuid.uuid4().hex[:8]}" for _ in range(2))
    (old_dir, old_log), (new_dir, _) = run_dir(old), run_dir(new)
    past = time.time() - stale_shm.STALE_RUN_DIR_S - 5
    os.utime(old_dir, (past, past))
    monkeypatch.setattr(stale_shm, "_tritonserver_running", lambda: True)
    assert old_dir not in remove_stale_shared_memory() and old_dir.is_dir()  # a server runs: leave it be
    monkeypatch.setattr(stale_shm, "_tritonserver_running", lambda: False)
    removed = remove_stale_shared_memory()
    assert old_dir in removed and not old_dir.exists() and old_log.exists()
    assert new_dir.is_dir(), "a directory made a moment ago (its launcher about to take its lock) was removed"
