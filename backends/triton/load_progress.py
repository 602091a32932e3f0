"""What the launcher prints while a server starts: the log's path, then per model "loading", "loaded in N s" or
"failed to load: REASON" (from Triton's own lines, ``server_log.load_event``), and what a model has been doing for
a while when its load takes long: the stage's latest log line (``model_log``: "capturing CUDA graphs ...",
"compiling the sampler ..."), shown once it has lasted ``slow_s`` seconds and again every ``repeat_s``, or "still
loading" every ``repeat_s`` while it has logged nothing (importing torch takes a while on a busy machine). A stage's
warnings while it loads are shown at once.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from backends.triton import model_log
from backends.triton.server_log import load_event

SLOW_S = 5.0  # a load step shorter than this is not worth a line
REPEAT_S = 30.0


@dataclass
class _Loading:
    started: float  # monotonic seconds
    step: str | None = None  # the model's latest log line while loading
    step_started: float = 0.0
    shown: float | None = None  # when the step was last shown


class LoadProgress:
    """Turns a starting server's log lines into progress lines for ``say`` (one line each, no newline).

    Feed it lines (:meth:`line`) and call :meth:`tick` now and then, or let :meth:`follow` read a log file as it is
    written. ``clock``: monotonic seconds (tests pass their own).
    """

    def __init__(self, say: Callable[[str], None], slow_s: float = SLOW_S, repeat_s: float = REPEAT_S,
                 clock: Callable[[], float] = time.monotonic):
        self.say, self.slow_s, self.repeat_s, self.clock = say, slow_s, repeat_s, clock
        self.loading: dict[str, _Loading] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def line(self, text: str) -> None:
        """One line of the server log."""
        now = self.clock()
        event = load_event(text)
        if event is not None:
            model, what, reason = event
            if what == "loading":
                self.loading[model] = _Loading(now, step_started=now)
                self.say(f"{model}: loading")
            elif what == "loaded" and model in self.loading:
                self.say(f"{model}: loaded in {now - self.loading.pop(model).started:.1f} s")
            elif what == "failed":
                self.loading.pop(model, None)
                self.say(f"{model}: failed to load: {reason}")
            return
        tagged = model_log.parse(text)
        if tagged is None or tagged[0] not in self.loading:
            return
        model, level, message = tagged
        if level != "INFO":
            self.say(f"{model}: {level.lower()}: {message}")
            return
        state = self.loading[model]
        state.step, state.step_started, state.shown = message, now, None

    def tick(self) -> None:
        """Show each model's step that has lasted ``slow_s`` seconds (``repeat_s`` before it has logged one), and
        again every ``repeat_s`` after."""
        now = self.clock()
        for model, state in self.loading.items():
            lasted = now - state.step_started
            due = state.shown is None or now - state.shown >= self.repeat_s
            if lasted >= (self.slow_s if state.step else self.repeat_s) and due:
                self.say(f"{model}: {state.step or 'still loading'} ({lasted:.0f} s)")
                state.shown = now

    def follow(self, log_path: Path, period_s: float = 0.5) -> None:
        """Say where the log is, then read ``log_path`` as the server writes it, on a thread of its own, until
        :meth:`stop`."""
        self.say(f"tritonserver starting, log: {log_path}")
        self._thread = threading.Thread(target=self._follow, args=(Path(log_path), period_s),
                                        name="load-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Read what the log holds by now, then stop following it (the server's ready, or its start failed)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _follow(self, log_path: Path, period_s: float) -> None:
        pending = ""
        with open(log_path, "r", errors="replace") as log:  # the launcher has created it
            while True:
                stopping = self._stop.is_set()  # before the read: the last read sees everything written before
                pending += log.read()
                *lines, pending = pending.split("\n")
                for text in lines:
                    self.line(text)
                if stopping:
                    return
                self.tick()
                self._stop.wait(period_s)
