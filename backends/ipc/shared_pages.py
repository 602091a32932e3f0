"""The free list of a shared pool's pages, used by several model processes at once (no torch).

The patch pool's pages (docs/structures.md, "Shared pools"): flashcodec takes a group's pages when that
group has been decoded, the orchestrator returns them once the group is encoded or its request dropped.
Triton's model processes are independent, so the list lives in a file under /dev/shm: one byte per page
(0 free, 1 held), mapped by numpy in every process. Each read-modify-write holds an exclusive
``fcntl.flock`` on that file (between processes; the kernel drops it when a process dies) and a thread
lock (flock does not exclude threads sharing one open file). Frees in another process wake nobody: a
waiter polls (`wait_allocate`).
"""
from __future__ import annotations

import fcntl
import mmap
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

POLL_S = 0.005  # how often a waiter looks for pages freed by another process (seconds)


def path_for(name: str) -> Path:
    """The /dev/shm file of pool ``name``'s free list for this server (the launcher removes it at stop).

    Raises RuntimeError when no run directory is set (see ``backends.ipc.run_dir``).
    """
    from backends.ipc.run_dir import run_dir

    return Path("/dev/shm") / f"unifiedserve-{run_dir().name}-{name}.pages"


class SharedPageList:
    """Page indices ``0 .. num_total - 1`` of one pool, granted all or nothing, from any process.

    Make one with `create` (the pool's owner) or `attach` (everyone else). Only `wait_allocate` keeps
    its callers in arrival order; a thread calling `allocate` directly may pass them.
    """

    def __init__(self, path: Path, owner: bool):
        self.path = path
        self.owner = owner
        self._file = open(path, "r+b")
        self._map = mmap.mmap(self._file.fileno(), 0)
        self._state = np.frombuffer(self._map, dtype=np.uint8)  # [num_pages]: 0 free, 1 held
        self._mutex = threading.RLock()
        self._turn = threading.Condition(self._mutex)
        self._queue: deque[object] = deque()  # this process's waiters, oldest first

    @classmethod
    def create(cls, path: str | Path, num_pages: int) -> "SharedPageList":
        """Publish a list of ``num_pages`` free pages at ``path`` (replacing any stale one).

        Raises ValueError: ``num_pages`` is not a positive integer.
        """
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"{path}: num_pages must be a positive integer, got {num_pages!r}")
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(bytes(num_pages))
        tmp.rename(path)  # appears whole: attach() waits for it
        return cls(path, owner=True)

    @classmethod
    def attach(cls, path: str | Path, timeout_s: float = 120.0) -> "SharedPageList":
        """Map the list the owner published at ``path``, waiting for it up to ``timeout_s`` seconds.

        Raises TimeoutError when it does not appear.
        """
        path = Path(path)
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"page list {path} was not published within {timeout_s} s")
            time.sleep(0.05)
        return cls(path, owner=False)

    @property
    def num_total(self) -> int:
        """Pages in the pool (pages)."""
        return self._state.size

    @property
    def num_free(self) -> int:
        """Pages that no process holds now (pages)."""
        return self.num_total - int(np.count_nonzero(self._state))

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` pages (the lowest free indices), or None and nothing when fewer are free.

        Raises ValueError: ``n`` is not a non-negative integer.
        """
        _check_count(self, n)
        with self._locked():
            free = np.flatnonzero(self._state == 0)
            if free.size < n:
                return None
            pages = free[:n]
            self._state[pages] = 1
        return [int(p) for p in pages]

    def wait_allocate(self, n: int, cancelled: Callable[[], bool], poll_s: float = POLL_S) -> list[int] | None:
        """Take ``n`` pages, waiting for them (back-pressure) behind this process's earlier waiters.

        ``cancelled()`` is polled every ``poll_s`` seconds while waiting; returns None (nothing taken)
        once it is true. Raises ValueError: ``n`` is not an integer in [0, num_total] (it could never
        be granted).
        """
        _check_count(self, n)
        if n > self.num_total:
            raise ValueError(f"{self.path.name}: {n} pages requested, the pool has {self.num_total}")
        me = object()
        with self._turn:
            self._queue.append(me)
            try:
                while True:
                    if self._queue[0] is me and self.num_free >= n:
                        pages = self.allocate(n)
                        if pages is not None:
                            return pages
                    if cancelled():
                        return None
                    self._turn.wait(poll_s)
            finally:
                self._queue.remove(me)
                self._turn.notify_all()

    def free(self, pages: Iterable[int]) -> None:
        """Return held pages; all of them or, on error, none.

        Raises ValueError: a page is not held (double free, unknown page, or listed twice).
        """
        pages = [int(p) for p in pages]
        with self._locked():
            if len(set(pages)) != len(pages) or any(not 0 <= p < self.num_total or not self._state[p] for p in pages):
                bad = [p for p in pages if not 0 <= p < self.num_total or not self._state[p] or pages.count(p) > 1]
                raise ValueError(f"{self.path.name}: pages {bad} are not held (double free or unknown page)")
            self._state[pages] = 0
        with self._turn:
            self._turn.notify_all()

    def close(self) -> None:
        """Unmap; the owner also removes the file (after that, nobody can attach)."""
        if self.owner:
            self.path.unlink(missing_ok=True)
        with self._mutex:
            self._state = np.zeros(0, np.uint8)
            self._map.close()
            self._file.close()

    def _locked(self):
        return _Locked(self._mutex, self._file.fileno())

    def __repr__(self) -> str:
        return f"SharedPageList({self.path.name!r}, free={self.num_free}/{self.num_total})"


class _Locked:
    """The thread lock, then the file lock (in that order, so one thread at a time asks the kernel)."""

    def __init__(self, mutex: threading.RLock, fd: int):
        self.mutex, self.fd = mutex, fd

    def __enter__(self) -> None:
        self.mutex.acquire()
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except BaseException:
            self.mutex.release()
            raise

    def __exit__(self, *exc) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            self.mutex.release()


def _check_count(pages: SharedPageList, n) -> None:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"{pages.path.name}: cannot allocate {n!r} pages")
