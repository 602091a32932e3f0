"""Stale shared-memory files: a server's pools are removed only once its lock is free, so a live server's
files survive another launcher's sweep, also across containers that share /dev/shm."""
import fcntl
import uuid

from backends.launcher import SHM, remove_stale_shared_memory


def run_files(run: str) -> list:
    paths = [SHM / f"unifiedserve-{run}-{name}" for name in ("kv_pool", "flashcodec-0a1b")]
    paths.append(SHM / f"unifiedserve-{run}.lock")
    for path in paths:
        path.write_bytes(b"x")
    return paths


def test_a_held_run_is_kept_and_a_free_one_removed():
    live, gone = (f"unifiedserve-run-{uuid.uuid4().hex[:8]}" for _ in range(2))
    live_files, gone_files = run_files(live), run_files(gone)
    with open(live_files[-1], "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as the live server's launcher holds it
        try:
            removed = remove_stale_shared_memory()
            assert all(path.exists() for path in live_files)
            assert not any(path.exists() for path in gone_files) and set(gone_files) <= set(removed)
        finally:
            for path in live_files:
                path.unlink(missing_ok=True)
