"""Python's garbage collector in the serving processes: the heap frozen once the process has started (and in a stage's
process again after a long full collection), and any long collection logged.

A full (generation 2) collection walks every object the collector tracks, and holds the GIL while it does: every
thread of the process stops. After ``import torch`` and transformers a process tracks about 400,000 objects, and a
full collection of them took 200 ms on the 2-core CPU machine (86,000 objects and 43 ms in an OpenAI API process).
``gc.freeze()`` moves what exists into a permanent generation that collections skip, so later ones walk only what
serving has made since; vLLM's engine core and API server and SGLang's scheduler do the same after start-up.
Collections of 10 ms or more (two decode steps' gap on the H200) are logged as warnings with their generation and
what they freed: a stall of that size shows in the text streams' TBT tail (``bench/peer/``), and the log says whether
it was one. The first few such lines also say what the collector walked: how many objects it tracks outside the
frozen heap and their most common types (what serving made and kept since the freeze; the H200's encode_prefill
paused 46 and 70 ms in full collections despite its frozen heap: bench/results/peer/settings-2026-12-04/README.md).

What serving makes and keeps after the start-up freeze is walked by every later full collection: on the H200
encode_prefill held about 100,000 such objects once serving (most common: tuples, dicts, lists and torch.compile's
fake-tensor cache entries, ``_PySymInputStub`` and ``_DeconstructedSymType``: its compiled layers and vision blocks
are traced at its first steps, after the freeze), and two full collections paused it for 74 and 73 ms
(bench/results/peer/settings-twelfth-2026-12-04/README.md). So in a stage's process (``refreeze``) what a long full
collection leaves is frozen too, after a collection of the young generations: later collections skip it. The cost:
whatever is alive then and later becomes cyclic garbage is never freed, nor any GPU memory such a cycle holds. A
stage's requests' state is freed by reference counting (no cycles), so what it keeps is its compiled graphs' caches;
the orchestrator and the OpenAI API, whose requests' asyncio tasks and futures form cycles, do not refreeze.
"""
from __future__ import annotations

import collections
import gc
import logging
import threading
import time

log = logging.getLogger(__name__)

LONG_PAUSE_MS = 10.0
DESCRIBED_PAUSES = 3  # the first long pauses whose log line also counts the unfrozen heap (a walk of it: O(objects))
TOP_TYPES = 5


def freeze_startup_heap() -> None:
    """Collect once, then freeze every object left (``gc.freeze``): call it when the process is ready to serve."""
    gc.collect()
    gc.freeze()


def watch_collections(process: str, refreeze: bool = False, threshold_ms: float = LONG_PAUSE_MS,
                      every_s: float = 1.0) -> None:
    """From now on, log a warning naming ``process`` for every collection of ``threshold_ms`` ms or more and, with
    ``refreeze``, collect the young generations and freeze the heap after such a full (generation 2) one (module
    docstring). The collector's callback (``gc.callbacks``, run in whichever thread's allocation started the
    collection) only notes the pause; a thread of its own logs the notes and freezes every ``every_s`` seconds, so
    that no log line is written from inside a collection (which may have started inside a write to the same
    stream)."""
    started: list[float] = []
    described_left = [True] * DESCRIBED_PAUSES
    pauses: collections.deque = collections.deque(maxlen=1000)

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            ms = (time.perf_counter() - started.pop()) * 1e3
            if ms >= threshold_ms:
                pauses.append((info["generation"], ms, info["collected"]))

    def report() -> None:
        while True:
            time.sleep(every_s)
            full = False
            while pauses:
                generation, ms, collected = pauses.popleft()
                described = bool(described_left) and described_left.pop()
                log.warning("%s: a generation-%d garbage collection paused the process for %.0f ms (%d objects "
                            "freed)%s", process, generation, ms, collected, unfrozen_heap() if described else "")
                full = full or generation == 2
            if full and refreeze:
                gc.collect(1)
                gc.freeze()

    gc.callbacks.append(timed)
    threading.Thread(target=report, name="gc-pause-log", daemon=True).start()


def unfrozen_heap() -> str:
    """What a full collection walks: ``"; N objects tracked outside the frozen heap, most: dict 812, ..."``."""
    tracked = gc.get_objects()  # every generation but the permanent (frozen) one
    top = collections.Counter(type(o).__name__ for o in tracked).most_common(TOP_TYPES)
    return f"; {len(tracked)} objects tracked outside the frozen heap, most: " + ", ".join(f"{n} {c}" for n, c in top)
