"""A thread that runs the callables posted to it, in the order posted: decode's step messages and metric round
trips to the Triton process leave from it, so the loop goes on with its next step, whose GPU work hides the send
(bench/RESULTS.md, "decode stage sends")."""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

log = logging.getLogger(__name__)


class SendThread:
    """Runs ``post``-ed callables one after another on a daemon thread named ``name``; a callable that raises is
    logged and the next runs."""

    def __init__(self, name: str):
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # (callable, args); None stops the thread
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def post(self, send: Callable, *args) -> None:
        """Run ``send(*args)`` on the thread, after everything posted before it."""
        self._outbox.put((send, args))

    def close(self, timeout_s: float = 10.0) -> None:
        """Run what is posted, then stop the thread (waiting at most ``timeout_s``)."""
        self._outbox.put(None)
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while (item := self._outbox.get()) is not None:
            send, args = item
            try:
                send(*args)
            except Exception:
                log.exception("%s could not send %s", self._thread.name, getattr(send, "__name__", send))
