"""A fair queue of work items between keys (requests) for a fixed number of workers (pure Python, no threads).

Why: with one first-in first-out queue, a request that sends many large media items takes every worker and
other requests' small items wait behind all of them (issue 18: a 64x64 PNG went from 0.05 s to 7.4 s). Here
each key has its own FIFO, and a free worker takes the next item of the key that has the fewest items running
(ties: the key served least recently, one that had nothing queued or running first, so keys take turns). A key
alone uses every worker. Running items are never interrupted, so an item put beside a busy key waits for the
first worker to become free, not for the busy key's queue; while several keys wait, the workers are shared out
evenly between them as items end. One key's items start in the order they were put.
"""
from __future__ import annotations

from collections import deque
from typing import Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class FairQueue(Generic[K, T]):
    """Items per key for ``slots`` workers. Not thread-safe: the caller holds its own lock around each call.

    ``take()`` hands out the next item and counts it running for its key until ``done(key)``; ``drop(key)`` and
    ``drain()`` remove queued items (an abort, a stop) without touching the running counts. Raises ValueError
    for ``slots`` < 1, and from ``done`` for a key with nothing running (a slot returned twice would let more
    items run than there are workers)."""

    def __init__(self, slots: int):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self._queued: dict[K, deque[T]] = {}  # keys with queued items -> the items, in order
        self._turn: dict[K, int] = {}  # keys with items queued or running -> the take that last served them, or -1
        self._running: dict[K, int] = {}  # keys with running items -> their count
        self._busy = 0  # items running, all keys
        self._serial = 0  # takes so far

    def put(self, key: K, item: T) -> None:
        """Queue ``item`` after ``key``'s other queued items."""
        self._queued.setdefault(key, deque()).append(item)
        self._turn.setdefault(key, -1)

    def take(self) -> tuple[K, T] | None:
        """The next item to run and its key, counted running; None when every slot is busy or nothing is queued."""
        if self._busy >= self.slots or not self._queued:
            return None
        key = min(self._queued, key=lambda k: (self._running.get(k, 0), self._turn[k]))
        items = self._queued[key]
        item = items.popleft()
        if not items:
            del self._queued[key]
        self._turn[key] = self._serial
        self._serial += 1
        self._running[key] = self._running.get(key, 0) + 1
        self._busy += 1
        return key, item

    def done(self, key: K) -> None:
        """One of ``key``'s running items has ended (however it ended): its slot is free."""
        count = self._running.get(key, 0)
        if not count:
            raise ValueError(f"done({key!r}) without a running item")
        if count == 1:
            del self._running[key]
            if key not in self._queued:
                del self._turn[key]
        else:
            self._running[key] = count - 1
        self._busy -= 1

    def drop(self, key: K) -> list[T]:
        """Remove and return ``key``'s queued items, in order (its running ones go on)."""
        items = list(self._queued.pop(key, ()))
        if key not in self._running:
            self._turn.pop(key, None)
        return items

    def drain(self) -> list[tuple[K, T]]:
        """Remove and return every queued item with its key."""
        items = [(key, item) for key, queued in self._queued.items() for item in queued]
        self._queued.clear()
        self._turn = {key: turn for key, turn in self._turn.items() if key in self._running}
        return items

    @property
    def busy(self) -> int:
        """Items running now, all keys (at most ``slots``)."""
        return self._busy

    def __len__(self) -> int:
        """Items queued, all keys."""
        return sum(len(items) for items in self._queued.values())
