"""What a tritonserver log says about its models: why one did not load, which ones never unloaded."""
from __future__ import annotations

import re
from typing import Iterable

# Triton's line for a model that did not load: "failed to load 'NAME' version N: Internal: REASON\nAt: ..." (the
# traceback after an escaped newline)
_LOAD_FAILED = re.compile(r"failed to load '([^']+)' version \d+: (?:Internal: )?(.*?)(?:\\n|\"?$)", re.MULTILINE)
# Its lines for a model's load starting and ending well: "loading: NAME:1", "successfully loaded 'NAME'"
_LOADING = re.compile(r'"loading: ([^:"]+):\d+"')
_LOADED = re.compile(r"successfully loaded '([^']+)'")
# The Python backend's reason when a model's stub process died during its load (no exception to give)
_DEAD_STUB = "is not healthy"
DEAD_STUB_HINT = ("its process died without an error of its own: killed by a signal (the kernel's out-of-memory "
                  "killer when the host ran out of memory: see dmesg) or a crash in native code")


def load_errors(log: str) -> list[str]:
    """"model NAME did not load: REASON" for each model that a tritonserver log says failed to load (the
    exception its ``initialize`` raised, first line; where its stub process died instead, :data:`DEAD_STUB_HINT`
    follows Triton's reason), in log order, each model once."""
    found: dict[str, str] = {}
    for model, reason in _LOAD_FAILED.findall(log):
        found.setdefault(model, f"{reason} ({DEAD_STUB_HINT})" if _DEAD_STUB in reason else reason)
    return [f"model {model} did not load: {reason}" for model, reason in found.items()]


def still_loading(log: str) -> list[str]:
    """The models whose load a tritonserver log shows starting but neither ending well nor failing, in log order:
    for a start that timed out, the stage that never finished loading."""
    state: dict[str, str] = {}
    for line in log.splitlines():
        event = load_event(line)
        if event is not None:
            state[event[0]] = event[1]
    return [model for model, event in state.items() if event == "loading"]


def load_event(line: str) -> tuple[str, str, str] | None:
    """(model, event, reason) for one tritonserver log line about a model's load: event "loading", "loaded" or
    "failed" (reason: the exception's first line, else ""); None for other lines."""
    for event, pattern in (("loading", _LOADING), ("loaded", _LOADED), ("failed", _LOAD_FAILED)):
        match = pattern.search(line)
        if match:
            return match[1], event, match[2] if event == "failed" else ""
    return None


def not_unloaded(log: str, models: Iterable[str]) -> str:
    """"model NAME had not unloaded" for those of ``models`` whose unload the log does not show, or "every model
    had unloaded"; where the log shows Triton waiting for HTTP connections until its exit timeout ran out (Triton
    2.51 waits for them before it unloads anything: an idle keep-alive client is enough), that is said instead."""
    if re.search(r"Timeout 1: Found \d+ HTTP service connections", log):
        return ("an HTTP client kept its connection open through Triton's exit timeout, which waits for HTTP "
                "connections to close before it unloads any model: a keep-alive connection is enough")
    stuck = sorted(model for model in set(models) if f"successfully unloaded '{model}'" not in log)
    return f"model {', '.join(stuck)} had not unloaded" if stuck else "every model had unloaded"
