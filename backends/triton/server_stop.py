"""Stopping a server cleanly: the launcher announces the stop in the run directory, the models end their
streams (drain), and only then is tritonserver signalled.

Why the models must be told: Triton calls a model's ``finalize()`` only once every response sender of the
model has sent its final flag (an open sender holds the model), so the orchestrator, whose client streams are
such senders, must end them itself; otherwise it never unloads and tritonserver gives up at
``--exit-timeout-secs`` ("Non-graceful termination"). The 2.51 Python backend has no stop hook, and asking
the server (``pb_utils.is_model_ready`` fails once the server is exiting) is not safe: on that error path the
stub reads the message after the server has freed it (seen here: stub segfaults, and a boost
``lock_exception`` that aborted tritonserver).

Why drain before the signal: once signalled, Triton unloads every model at once, in no order, so a stage could
go while the orchestrator still waits on one of its calls (decode's step stream, a video's group stream). So:

1. the launcher writes the ``stopping`` marker (:func:`announce`); each model's :class:`StopWatch` sees it
   (a ``stat`` every ``period_s``, no IPC) and ends its work: the orchestrator fails the requests in flight
   ("the server is shutting down"), the stages end their streams;
2. the orchestrator writes ``drained`` (:func:`mark_drained`) once no request and no stage call is left;
3. the launcher waits for it (:func:`wait_drained`, bounded), then signals tritonserver, which now finds
   every model idle and unloads them at once.

A plain tritonserver (no launcher) signalled to stop unloads its models at once, the stages first (nothing holds
them), whose links closing under the orchestrator's requests failed those with "decode: the stage closed its link".
So a stage's ``finalize`` first announces the stop itself and waits for the orchestrator's drain
(:func:`drain_before_unload`): the requests end with "the server is shutting down", as under the launcher. The
orchestrator marks ``drained`` at its own ``finalize`` too, so that a stage unloading after it does not wait, and
takes the mark back when it loads again (:func:`serving_again`: Triton's model control may reload it alone).
"""
from __future__ import annotations

import gc
import logging
import threading
import time
from pathlib import Path
from typing import Callable

from backends.ipc import run_dir as run_directory

log = logging.getLogger(__name__)
MARKER = "stopping"
DRAINED = "drained"


def announce(run_dir: Path, why: str = "") -> None:
    """Tell the models of the server using ``run_dir`` that it is about to stop; ``why`` (the marker's text, empty
    for the launcher's stop) is added to the orchestrator's refusals from then on (:func:`why_stopping`)."""
    (Path(run_dir) / MARKER).write_text(why)


def why_stopping() -> str:
    """The text :func:`announce` wrote in this server's marker ("" when none, or no marker)."""
    try:
        return (run_directory.run_dir() / MARKER).read_text().strip()
    except FileNotFoundError:
        return ""


def announced() -> bool:
    """Whether the stop has been announced for this server (its run directory): a stage's stream that ends
    early may be the stage stopping a little before this model's own watch has noticed."""
    return (run_directory.run_dir() / MARKER).exists()


def mark_drained() -> None:
    """The orchestrator's word that no request and no stage stream is left (this server's run directory)."""
    (run_directory.run_dir() / DRAINED).touch()


def serving_again() -> None:
    """The orchestrator's word, as it loads, that it has not drained: a ``drained`` mark its last ``finalize`` left
    (Triton's model control unloaded and loaded it alone) would let a stage unloading later skip the announcement
    and the drain, and the requests then ended with "decode: the stage closed its link"."""
    (run_directory.run_dir() / DRAINED).unlink(missing_ok=True)


def wait_drained(run_dir: Path, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` seconds for :func:`mark_drained`; True when it came."""
    deadline = time.monotonic() + timeout_s
    while not (Path(run_dir) / DRAINED).exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


UNLOAD_DRAIN_S = 5.0  # a stage's wait in its finalize for the orchestrator's drain (a plain tritonserver's stop)


def drain_before_unload(model_name: str, timeout_s: float = UNLOAD_DRAIN_S) -> bool:
    """A stage's first step in ``finalize``: unless the orchestrator has drained already (the launcher's stop, or
    its own finalize), announce the stop in this server's run directory, naming ``model_name`` (the unload of one
    stage by Triton's model control ends the serving too: the orchestrator does not take a stage back), and wait up
    to ``timeout_s`` seconds for the drain, so that no request is left waiting on this stage when its link closes.
    True when drained."""
    run_dir = run_directory.run_dir()
    if (run_dir / DRAINED).exists():
        return True
    announce(run_dir, f"its model {model_name} was unloaded; if the server did not stop, a model was unloaded "
                      "alone: unload all its models and load them again, or restart it")
    return wait_drained(run_dir, timeout_s)


def before_exit() -> None:
    """The last call of a model's ``finalize()``: the stub exits next, and its interpreter's final garbage
    collection walks every torch/transformers object (about a second, several on a busy machine, all of it
    counted against the server's exit timeout). Frozen objects are skipped; the process frees its memory."""
    gc.freeze()


class StopWatch:
    """Calls ``on_stop()`` once, on a thread of its own, when the stop is announced in the run directory.

    ``on_stop`` must not block (it only tells the model's own loops to end their streams). :meth:`close`
    (in ``finalize``) joins the thread, so that ``on_stop`` never runs after ``finalize`` returns.
    Raises RuntimeError when no run directory is set (see ``backends.ipc.run_dir``).
    """

    def __init__(self, on_stop: Callable[[], None], period_s: float = 0.1):
        self.marker = run_directory.run_dir() / MARKER
        self.on_stop, self.period_s = on_stop, period_s
        self.stopped = threading.Event()  # set once the stop was seen (before on_stop runs)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stop-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._closed.wait(self.period_s):
            if self.marker.exists():
                self.stopped.set()
                try:
                    self.on_stop()
                except Exception:
                    log.exception("stop watch: on_stop failed")
                return
