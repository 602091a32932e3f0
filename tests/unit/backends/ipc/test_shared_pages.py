"""The patch pages' free list shared between processes (backends/ipc/shared_pages.py)."""
from __future__ import annotations

import fcntl
import multiprocessing
import threading
import time

import pytest

from backends.ipc.shared_pages import SharedPageList

SPAWN = multiprocessing.get_context("spawn")  # fresh interpreters, as Triton's model processes are


def take(path, n, results):
    results.put(SharedPageList.attach(path, timeout_s=10).allocate(n))


def free_later(path, pages, delay_s):
    time.sleep(delay_s)
    SharedPageList.attach(path, timeout_s=10).free(pages)


def hold_the_lock(path, locked):
    pages = SharedPageList.attach(path, timeout_s=10)
    pages._locked().__enter__()
    locked.set()
    time.sleep(60)


def run(target, *args):
    process = SPAWN.Process(target=target, args=args)
    process.start()
    return process


@pytest.fixture
def pages(tmp_path):
    owner = SharedPageList.create(tmp_path / "patch_pool.pages", 4)
    yield owner
    owner.close()


def test_another_process_allocates_and_the_owner_frees(pages):
    results = SPAWN.Queue()
    child = run(take, pages.path, 3, results)
    taken = results.get(timeout=30)
    child.join(timeout=30)
    assert sorted(taken) == [0, 1, 2] and pages.num_free == 1
    assert pages.allocate(2) is None and pages.allocate(1) == [3]
    pages.free(taken)
    child = run(take, pages.path, 3, results)  # what one process freed, another takes
    assert sorted(results.get(timeout=30)) == [0, 1, 2]
    child.join(timeout=30)
    assert pages.num_free == 0 and pages.num_total == 4


@pytest.mark.parametrize("bad", [[0], [9], [-1], [1, 1]])
def test_double_free_and_unknown_pages_raise_and_free_nothing(pages, bad):
    held = pages.allocate(2)  # pages 0 and 1
    pages.free([0])
    with pytest.raises(ValueError, match="not held"):
        pages.free(bad)
    assert pages.num_free == 3
    pages.free(held[1:])
    with pytest.raises(ValueError, match="double free"):
        pages.free(held[1:])


def test_waiting_wakes_up_when_another_process_frees(pages):
    held = pages.allocate(4)
    child = run(free_later, pages.path, held[:2], 0.5)
    started = time.monotonic()
    got = pages.wait_allocate(2, cancelled=lambda: False)
    assert sorted(got) == held[:2] and time.monotonic() - started >= 0.3
    child.join(timeout=30)
    assert child.exitcode == 0 and pages.num_free == 0


def test_a_cancelled_wait_returns_none_and_takes_nothing(pages):
    pages.allocate(3)
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    assert pages.wait_allocate(2, cancelled=stop.is_set) is None
    assert 0.15 < time.monotonic() - started < 5 and pages.num_free == 1
    with pytest.raises(ValueError, match="the pool has 4"):  # could never be granted: refused, not waited for
        pages.wait_allocate(5, cancelled=lambda: False)


def test_waiters_of_one_process_are_served_in_arrival_order(pages):
    pages.allocate(4)
    got: dict[str, list[int]] = {}

    def wait(name, n):
        got[name] = pages.wait_allocate(n, cancelled=lambda: False)

    def queued(n: int) -> None:  # until n waiters are in line (a sleep could end before a thread got there)
        deadline = time.monotonic() + 5
        while len(pages._queue) < n:
            assert time.monotonic() < deadline, "no waiter in line"
            time.sleep(0.005)

    first = threading.Thread(target=wait, args=("first", 2))
    first.start()
    queued(1)
    second = threading.Thread(target=wait, args=("second", 1))
    second.start()
    queued(2)
    pages.free([0])  # enough for the second, not the first: the second must not pass it
    time.sleep(0.1)
    assert got == {}
    pages.free([1])
    first.join(timeout=5)
    assert sorted(got["first"]) == [0, 1] and "second" not in got
    pages.free([2])
    second.join(timeout=5)
    assert got["second"] == [2]


def test_a_process_that_dies_holding_the_lock_releases_it(pages):
    locked = SPAWN.Event()
    child = run(hold_the_lock, pages.path, locked)
    assert locked.wait(timeout=30)
    with open(pages.path, "rb") as f:
        with pytest.raises(BlockingIOError):
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    child.kill()
    child.join(timeout=30)
    assert pages.allocate(4) == [0, 1, 2, 3]


def test_attach_waits_for_the_owner_then_times_out(tmp_path):
    with pytest.raises(TimeoutError, match="never.pages"):
        SharedPageList.attach(tmp_path / "never.pages", timeout_s=0.2)
    with pytest.raises(ValueError, match="positive"):
        SharedPageList.create(tmp_path / "empty.pages", 0)


def test_close_by_the_owner_removes_the_file(tmp_path):
    owner = SharedPageList.create(tmp_path / "p.pages", 2)
    mapper = SharedPageList.attach(owner.path)
    mapper.allocate(1)
    assert owner.num_free == 1
    mapper.close()
    owner.close()
    assert not owner.path.exists()
