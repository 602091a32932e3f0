"""``python -m backends.openai``'s worker app (backends/openai/__main__.py): built from the command line its parent
passed on, then the process's heap frozen and its long garbage collections logged (backends/gc_heap.py)."""
import gc
import json

from backends.openai import __main__ as main


def test_a_workers_app_is_built_then_its_heap_frozen(monkeypatch):
    monkeypatch.setenv(main.CONFIG_ENV, json.dumps(["--grpc-url", "127.0.0.1:1"]))
    callbacks = list(gc.callbacks)
    gc.unfreeze()
    try:
        app = main.app_from_env()
        assert app.title.startswith("UnifiedServe") and gc.get_freeze_count() > 0
        assert len(gc.callbacks) == len(callbacks) + 1
    finally:
        gc.unfreeze()
        gc.callbacks[:] = callbacks
