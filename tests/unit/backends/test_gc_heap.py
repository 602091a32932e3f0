"""The serving processes' garbage collector (backends/gc_heap.py): the start-up heap frozen, long collections
logged with the process's name, from a thread of their own."""
import gc
import logging
import time

import pytest

from backends import gc_heap


@pytest.fixture
def callbacks():
    """gc.callbacks as it was before the test, after it (the collector holds that very list), and the heap unfrozen."""
    saved = list(gc.callbacks)
    yield
    gc.callbacks[:] = saved
    gc.unfreeze()


def test_the_startup_heap_is_frozen():
    kept = [[k] for k in range(1000)]
    gc.unfreeze()
    try:
        gc_heap.freeze_startup_heap()
        assert gc.get_freeze_count() > len(kept)
    finally:
        gc.unfreeze()


def logged(caplog, wait_s: float) -> list[str]:
    deadline = time.monotonic() + wait_s
    while not caplog.records and time.monotonic() < deadline:
        time.sleep(0.01)
    return [r.getMessage() for r in caplog.records if r.name == "backends.gc_heap"]


@pytest.mark.usefixtures("callbacks")
def test_a_collection_over_the_threshold_is_logged_and_a_short_one_is_not(caplog):
    with caplog.at_level(logging.WARNING, logger="backends.gc_heap"):
        gc_heap.watch_collections("decode", threshold_ms=0.0, every_s=0.01)
        gc.collect(2)
        lines = logged(caplog, 5.0)
    assert lines and lines[0].startswith("decode: a generation-2 garbage collection paused the process for"), lines
    assert "objects tracked outside the frozen heap, most: " in lines[0], lines  # the first lines say what it walked
    gc.callbacks[:] = [c for c in gc.callbacks if getattr(c, "__qualname__", "").split(".")[0] != "watch_collections"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="backends.gc_heap"):
        gc_heap.watch_collections("decode", threshold_ms=60_000.0, every_s=0.01)
        gc.collect(2)
        assert not logged(caplog, 0.2)


def test_the_unfrozen_heap_is_counted_by_type():
    kept = [{"k": k} for k in range(5000)]
    counted = gc_heap.unfrozen_heap()
    tracked = int(counted.split(";")[1].split()[0])
    assert tracked >= len(kept) and "dict " in counted, counted


@pytest.mark.usefixtures("callbacks")
@pytest.mark.parametrize("refreeze", [True, False])
def test_a_stage_freezes_what_a_long_full_collection_left(caplog, refreeze):
    """With ``refreeze`` (a stage's process) a long generation-2 collection freezes the heap; a long generation-1
    one does not, nor does any collection without ``refreeze`` (the orchestrator, the OpenAI API)."""
    gc.unfreeze()
    with caplog.at_level(logging.WARNING, logger="backends.gc_heap"):
        gc_heap.watch_collections("encode_prefill", refreeze=refreeze, threshold_ms=0.0, every_s=0.01)
        gc.collect(1)
        assert logged(caplog, 5.0)
        time.sleep(0.1)  # ten of the reporter's rounds
        assert gc.get_freeze_count() == 0
        kept = [[k] for k in range(1000)]
        gc.collect(2)
        deadline = time.monotonic() + (5.0 if refreeze else 0.1)
        while gc.get_freeze_count() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert (gc.get_freeze_count() > len(kept)) is refreeze


@pytest.mark.usefixtures("callbacks")
def test_a_short_full_collection_freezes_nothing():
    gc.unfreeze()
    gc_heap.watch_collections("encode_prefill", refreeze=True, threshold_ms=60_000.0, every_s=0.01)
    gc.collect(2)
    time.sleep(0.1)
    assert gc.get_freeze_count() == 0
