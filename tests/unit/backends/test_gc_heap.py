"""The serving processes' garbage collector (backends/gc_heap.py): the start-up heap frozen, long collections
logged with the process's name."""
import gc
import logging

import pytest

from backends import gc_heap


@pytest.fixture
def callbacks():
    """gc.callbacks as it was before the test, after it (the collector holds that very list)."""
    saved = list(gc.callbacks)
    yield
    gc.callbacks[:] = saved


def test_the_startup_heap_is_frozen():
    kept = [[k] for k in range(1000)]
    gc.unfreeze()
    try:
        gc_heap.freeze_startup_heap()
        assert gc.get_freeze_count() > len(kept)
    finally:
        gc.unfreeze()


@pytest.mark.usefixtures("callbacks")
def test_a_collection_over_the_threshold_is_logged_and_a_short_one_is_not(caplog):
    gc_heap.log_long_pauses("decode", threshold_ms=0.0)
    with caplog.at_level(logging.WARNING, logger="backends.gc_heap"):
        gc.collect(2)
    assert any(r.getMessage().startswith("decode: a generation-2 garbage collection paused the process for")
               for r in caplog.records)
    gc.callbacks.pop()
    gc_heap.log_long_pauses("decode", threshold_ms=60_000.0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="backends.gc_heap"):
        gc.collect(2)
    assert not caplog.records
