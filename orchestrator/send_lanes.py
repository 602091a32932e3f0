"""Client responses sent from a few threads, not the orchestrator's event loop.

Each ``ResponseSender.send`` is a round trip to the Triton process: the 2.51 stub releases the GIL and waits
until one of the server's threads has taken the response (python_backend ``src/response_sender.cc``); about
0.4 ms each on the 2-core CPU machine, under load. Sent from the event loop, the sends of one decode step's
tokens run one after the other and hold up everything else the loop does; from ``lanes`` threads they overlap,
and the loop goes on. A request keeps one lane for all its responses, so they leave in order and its final
flag comes last.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading

log = logging.getLogger(__name__)


class SendLanes:
    """``lanes`` sender threads (at least 1). :meth:`lane` picks one for a new request (round robin);
    :meth:`send` queues ``sender.send(response, flags=flags)`` on it; :meth:`close` sends what is queued and
    stops the threads."""

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

    def send(self, lane: int, sender, response=None, flags: int = 0) -> None:
        self._queues[lane].put((sender, response, flags))

    def close(self, timeout_s: float = 5.0) -> None:
        for q in self._queues:
            q.put(None)
        for thread in self._threads:
            thread.join(timeout_s)

    @staticmethod
    def _run(q: queue.SimpleQueue) -> None:
        while (item := q.get()) is not None:
            sender, response, flags = item
            try:
                sender.send(response, flags=flags)
            except Exception:  # e.g. the client's stream was closed: nothing to tell it, the lane goes on
                log.exception("orchestrator: a response could not be sent")
