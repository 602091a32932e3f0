"""Client responses built and sent from a few threads, not the orchestrator's event loop.

Each ``ResponseSender.send`` is a round trip to the Triton process: the 2.51 stub releases the GIL and waits
until one of the server's threads has taken the response (python_backend ``src/response_sender.cc``); about
0.4 ms each on the 2-core CPU machine, under load. Sent from the event loop, the sends of one decode step's
tokens run one after the other and hold up everything else the loop does; from ``lanes`` threads they overlap,
and the loop goes on. The loop queues plain-Python items; the lane builds each item's response. A request keeps
one lane for all its responses, so they leave in order and its final flag comes last. A lane that fell behind
finds several items of one request queued and merges consecutive ones into one response (vLLM's output collector
does the same when its consumer is slow), so that a backlog costs fewer sends instead of delaying every token.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
from typing import Protocol

log = logging.getLogger(__name__)


class Item(Protocol):
    """What a lane sends: ``sender.send(item.build(), flags=item.flags)``; ``trailing`` items (e.g. a request's
    timeline, whose JSON takes a while to build) go after the other items queued with them (:func:`merged`), and
    after those queued while these were sent, if any (a step's tokens reach a lane one request at a time); no
    later."""

    flags: int
    trailing: bool

    def merge(self, later: Item) -> Item | None:
        """This item and ``later`` (the same request's next) as one item, or None when they do not merge."""

    def build(self):
        """The Triton response (None: a response without outputs, e.g. an empty final one)."""

    def sent(self) -> None:
        """Called once the response has been handed to Triton (e.g. to note when on a request's timeline)."""


class SendLanes:
    """``lanes`` sender threads (at least 1). :meth:`lane` picks one for a new request (round robin);
    :meth:`send` queues a request's item on it; :meth:`close` sends what is queued and stops the threads."""

    def __init__(self, lanes: int = 4):
        if lanes < 1:
            raise ValueError(f"lanes must be at least 1, got {lanes}")
        self._queues = [queue.SimpleQueue() for _ in range(lanes)]
        self._next = itertools.count()
        self._threads = [threading.Thread(target=self._run, args=(q,), name=f"send-lane-{k}", daemon=True)
                         for k, q in enumerate(self._queues)]
        for thread in self._threads:
            thread.start()

    def lane(self) -> int:
        return next(self._next) % len(self._queues)

    def send(self, lane: int, sender, item: Item) -> None:
        """Queue ``item`` for ``sender`` (one request's ``ResponseSender``) on ``lane``; the items of one sender
        must all go to one lane, its final one last."""
        self._queues[lane].put((sender, item))

    def close(self, timeout_s: float = 5.0) -> None:
        for q in self._queues:
            q.put(None)
        for thread in self._threads:
            thread.join(timeout_s)

    @staticmethod
    def _run(q: queue.SimpleQueue) -> None:
        stopped, held = False, []
        while not stopped:
            queued, stopped = _take(q)
            now, trailing = _partition(queued)
            _send(now + held)  # held one round already: not again
            # more was queued while the tokens went (a step's other requests): it goes before these, once
            held = trailing if trailing and not stopped and not q.empty() else []
            if not held:
                _send(trailing)


def _send(out: list[tuple[object, Item]]) -> None:
    for sender, item in out:
        try:
            sender.send(item.build(), flags=item.flags)
            item.sent()
        except Exception:  # e.g. the client's stream was closed: nothing to tell it, the lane goes on
            log.exception("orchestrator: a response could not be sent")


def _take(q: queue.SimpleQueue) -> tuple[list[tuple[object, Item]], bool]:
    """Every ``(sender, item)`` in ``q``, waiting for the first, and whether ``close`` stopped the lane."""
    entry, queued = q.get(), []
    while entry is not None:
        queued.append(entry)
        try:
            entry = q.get_nowait()
        except queue.Empty:
            return queued, False
    return queued, True


def merged(queued: list[tuple[object, Item]]) -> list[tuple[object, Item]]:
    """``queued`` with each item merged into the same sender's item before it where they merge, the ``trailing``
    items after the others. Each request's items keep their order (a trailing item is its request's last); those
    of different requests may pass one another, on one sender too (a token channel's)."""
    now, trailing = _partition(queued)
    return now + trailing


def _partition(queued: list[tuple[object, Item]]) -> tuple[list[tuple[object, Item]], list[tuple[object, Item]]]:
    """:func:`merged`'s two parts: the items that are not ``trailing``, merged, and the trailing ones, merged."""
    now, trailing = [], []
    for entry in queued:
        (trailing if entry[1].trailing else now).append(entry)
    return _merged(now), _merged(trailing)


def _merged(queued: list[tuple[object, Item]]) -> list[tuple[object, Item]]:
    out: list[tuple[object, Item]] = []
    last: dict[int, int] = {}  # id(sender) -> index in out of its latest item (the senders are alive: in queued)
    for sender, item in queued:
        at = last.get(id(sender))
        both = out[at][1].merge(item) if at is not None else None
        if both is not None:
            out[at] = (sender, both)
        else:
            last[id(sender)] = len(out)
            out.append((sender, item))
    return out
