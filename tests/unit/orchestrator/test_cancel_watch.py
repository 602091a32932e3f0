"""Clients' cancellations polled from one thread (orchestrator/cancel_watch.py)."""
import threading
import time

from orchestrator.cancel_watch import CancelWatch


def test_a_cancellation_is_seen_and_nobody_is_asked_after_unwatch():
    calls = {"a": 0, "b": 0}
    lock = threading.Lock()

    def asker(name, cancel_after):
        def is_cancelled():
            with lock:
                calls[name] += 1
                return calls[name] >= cancel_after
        return is_cancelled

    watch = CancelWatch(period_s=0.01)
    try:
        a, b = watch.watch(asker("a", 3)), watch.watch(asker("b", 10**9))
        assert a.cancelled.wait(5) and not b.cancelled.is_set()
        time.sleep(0.05)
        asked = calls["a"]
        assert asked == 3  # not asked again once cancelled
        watch.unwatch(b)
        after = calls["b"]
        time.sleep(0.1)
        assert calls["b"] == after  # never asked after unwatch returned
    finally:
        watch.close()


def test_a_failing_question_ends_the_watch_of_that_request_only():
    def broken():
        raise RuntimeError("the request has gone")

    watch = CancelWatch(period_s=0.01)
    try:
        bad, good = watch.watch(broken), watch.watch(lambda: True)
        assert good.cancelled.wait(5)
        time.sleep(0.05)
        assert bad.done and not bad.cancelled.is_set()
    finally:
        watch.close()
