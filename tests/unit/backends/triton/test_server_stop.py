"""Stopping a server cleanly without Triton: the stop watch sees the launcher's marker, a stage unloading first
lets the orchestrator drain, the decode stage ends its step stream, flashcodec ends its group streams
(backends/triton/server_stop.py)."""
from __future__ import annotations

import queue
import threading
import time

import pytest
import torch

from backends.ipc.run_dir import RUN_DIR_ENV
from backends.triton import server_stop
from backends.runtime.loader import ModelSpec
from backends.stages.decode_worker import DecodeWorker


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    path = tmp_path / "run"
    path.mkdir()
    monkeypatch.setenv(RUN_DIR_ENV, str(path))
    return path


def test_the_watch_calls_on_stop_once_after_the_announcement(run_dir):
    calls = queue.Queue()
    watch = server_stop.StopWatch(lambda: calls.put(threading.current_thread().name), period_s=0.01)
    with pytest.raises(queue.Empty):
        calls.get(timeout=0.1)
    server_stop.announce(run_dir)
    assert calls.get(timeout=5) == "stop-watch" and watch.stopped.is_set()
    watch.close()
    assert calls.empty()


def test_close_stops_a_watch_that_never_fired(run_dir):
    watch = server_stop.StopWatch(lambda: pytest.fail("no stop was announced"), period_s=0.01)
    watch.close()
    server_stop.announce(run_dir)
    time.sleep(0.05)
    assert not watch.stopped.is_set()


def test_wait_drained(run_dir):
    started = time.monotonic()
    assert not server_stop.wait_drained(run_dir, timeout_s=0.1)
    assert time.monotonic() - started >= 0.1
    server_stop.mark_drained()
    assert server_stop.wait_drained(run_dir, timeout_s=0)


def test_a_stage_unloading_announces_the_stop_and_waits_for_the_drain(run_dir):
    """A plain tritonserver's stop: the stage's finalize announces it, the orchestrator's watch drains (here a
    thread marking it after 0.2 s), then the stage goes on; after a drain (the launcher's, or the orchestrator's
    finalize) it does not wait; without one it gives up after its timeout."""
    def orchestrator():
        while not (run_dir / server_stop.MARKER).exists():
            time.sleep(0.01)
        time.sleep(0.2)
        server_stop.mark_drained()

    threading.Thread(target=orchestrator, daemon=True).start()
    started = time.monotonic()
    assert server_stop.drain_before_unload("decode", timeout_s=10) and time.monotonic() - started >= 0.2
    started = time.monotonic()  # at once, not after waiting out the 10 s (loose for a paused test process)
    assert server_stop.drain_before_unload("decode", timeout_s=10) and time.monotonic() - started < 5
    server_stop.serving_again()  # the orchestrator loaded again (Triton's model control): its old mark goes
    assert not (run_dir / server_stop.DRAINED).exists()
    assert not server_stop.drain_before_unload("decode", timeout_s=0.2)
    server_stop.serving_again()  # no mark: nothing to take back


def test_the_marker_says_which_stage_announced_the_stop_and_the_launcher_s_says_nothing(run_dir):
    """A stage's finalize names its model (Triton's model control may have unloaded it alone: the orchestrator's
    refusals say so from then on); the launcher's stop leaves the text empty."""
    assert server_stop.why_stopping() == ""
    server_stop.drain_before_unload("flashcodec", timeout_s=0)
    assert server_stop.why_stopping().startswith("its model flashcodec was unloaded;")
    assert "unload all its models and load them again, or restart it" in server_stop.why_stopping()
    server_stop.announce(run_dir)
    assert server_stop.why_stopping() == ""


def test_the_decode_stage_ends_its_stream_when_told_and_at_shutdown(run_dir):
    worker = DecodeWorker(ModelSpec(), torch.device("cpu"), kv_pages=8, page_size=16, max_batch=4)
    ended = queue.Queue()
    try:
        worker.attach(lambda *step: None, lambda: ended.put("first"))
        worker.attach(lambda *step: None, lambda: ended.put("second"))  # a new stream replaces (ends) the old
        assert ended.get(timeout=10) == "first"
        worker.end_stream()
        assert ended.get(timeout=10) == "second" and worker.sink is None
        worker.attach(lambda *step: None, lambda: ended.put("third"))
    finally:
        worker.shutdown()
    assert ended.get(timeout=1) == "third" and not worker.thread.is_alive()  # never left open
