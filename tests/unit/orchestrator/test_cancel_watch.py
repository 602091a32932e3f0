"""Clients' cancellations polled from one thread and handed on once (orchestrator/cancel_watch.py)."""
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
    cancelled = {"a": threading.Event(), "b": threading.Event()}
    try:
        a, b = (watch.watch(asker(name, after), cancelled[name].set) for name, after in (("a", 3), ("b", 10**9)))
        assert cancelled["a"].wait(5) and not cancelled["b"].is_set()
        time.sleep(0.05)
        asked = calls["a"]
        assert asked == 3 and a.done  # not asked again once cancelled
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
    cancelled = {"bad": threading.Event(), "good": threading.Event()}
    try:
        bad = watch.watch(broken, cancelled["bad"].set)
        watch.watch(lambda: True, cancelled["good"].set)
        assert cancelled["good"].wait(5)
        time.sleep(0.05)
        assert bad.done and not cancelled["bad"].is_set()
    finally:
        watch.close()


def test_on_cancel_is_called_once_and_a_failing_one_ends_only_its_watch():
    calls = []

    def fails():
        calls.append("fails")
        raise RuntimeError("the event loop is closed")

    watch = CancelWatch(period_s=0.01)
    good = threading.Event()
    try:
        failing = watch.watch(lambda: True, fails)
        watch.watch(lambda: True, lambda: (calls.append("good"), good.set()))
        assert good.wait(5)
        time.sleep(0.1)
        assert sorted(calls) == ["fails", "good"] and failing.done
    finally:
        watch.close()
