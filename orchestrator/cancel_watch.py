"""The clients' cancellations, polled from one thread instead of the orchestrator's event loop.

``ResponseSender.is_cancelled()`` is a round trip to the Triton process that blocks its caller until the answer
comes (python_backend ``src/pb_cancel.cc``); polled every 50 ms for each request on the event loop, 32 streams
made 640 blocking round trips a second there. The watch thread makes them and, once a request's answer is yes,
calls that request's ``on_cancel`` (the frontend's hands the cancellation to the event loop, which ends the
request's stream), so the request's coroutine neither polls nor wakes on a timer.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger(__name__)


@dataclass(eq=False)  # hashed by identity: kept in a set
class Watched:
    """One request's cancellation: ``on_cancel()`` is called once the client has cancelled; ``done`` once it is
    not asked again (cancelled, unwatched, or its ``is_cancelled()`` failed)."""

    is_cancelled: Callable[[], bool]
    on_cancel: Callable[[], None]
    lock: threading.Lock = field(default_factory=threading.Lock)  # held while its is_cancelled() runs
    done: bool = False


class CancelWatch:
    """Polls ``is_cancelled()`` of every watched request each ``period_s`` seconds from one thread."""

    def __init__(self, period_s: float = 0.05):
        self.period_s = period_s
        self._watched: set[Watched] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cancel-watch", daemon=True)
        self._thread.start()

    def watch(self, is_cancelled: Callable[[], bool], on_cancel: Callable[[], None]) -> Watched:
        """Ask ``is_cancelled()`` every ``period_s`` seconds until it is true, then call ``on_cancel()`` once (both
        on the watch thread: ``on_cancel`` must not block)."""
        entry = Watched(is_cancelled, on_cancel)
        with self._lock:
            self._watched.add(entry)
        return entry

    def unwatch(self, entry: Watched) -> None:
        """No ``is_cancelled()`` or ``on_cancel()`` call for ``entry`` after this returns (it may wait for one in
        flight): call it before the request's final response is sent, after which the request must not be asked."""
        with entry.lock:
            entry.done = True
        with self._lock:
            self._watched.discard(entry)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            with self._lock:
                entries = list(self._watched)
            for entry in entries:
                with entry.lock:
                    if entry.done:
                        continue
                    try:
                        if entry.is_cancelled():
                            entry.done = True
                            entry.on_cancel()
                    except Exception:  # the request has gone (or its loop has): it is being finished anyway
                        log.exception("orchestrator: is_cancelled or on_cancel failed")
                        entry.done = True
                if entry.done:
                    with self._lock:
                        self._watched.discard(entry)
