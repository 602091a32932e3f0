"""The server's run directory: where the stages publish their pools' handles and link sockets (no torch).

The launcher creates one per server and names it in the environment variable ``UNIFIEDSERVE_RUN_DIR``, which
every model process inherits; in a server started without the launcher each model process names the one derived
from the server process there (``backends.triton.standalone``, at the start of its ``initialize``).
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

RUN_DIR_ENV = "UNIFIEDSERVE_RUN_DIR"


def run_dir() -> Path:
    """The server's run directory; raises RuntimeError when none is named (outside a model process or a launcher's
    server)."""
    value = os.environ.get(RUN_DIR_ENV)
    if not value:
        raise RuntimeError(f"{RUN_DIR_ENV} is not set: the launcher sets it, and so does each model's adaptor in a "
                           "server started without it (backends/triton/standalone.py)")
    return Path(value)


def meta_path(name: str) -> Path:
    """Where shared pool ``name``'s metadata appears once its owner has published it."""
    return run_dir() / f"{name}.json"


async def appeared(path: Path | str, timeout_s: float, poll_s: float = 0.05) -> bool:
    """Whether ``path`` exists within ``timeout_s`` seconds, polled every ``poll_s`` seconds on the event loop: a
    cancel ends the wait at once (a wait on a thread ran on, holding its process, e.g. one Triton was unloading)."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(poll_s)
    return True


def describe(name: str, timeout_s: float = 120.0) -> dict:
    """The published metadata of shared pool ``name`` (``shape``, ``dtype``, ``device``, and what its owner
    added), without mapping it (``backends.ipc.shared_tensor.create`` publishes it).

    Waits up to ``timeout_s`` seconds for the owner; raises TimeoutError when it never publishes.
    """
    path = meta_path(name)
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"shared pool {name!r} was not published in {path.parent} within {timeout_s} s")
        time.sleep(0.05)
    return json.loads(path.read_text())
