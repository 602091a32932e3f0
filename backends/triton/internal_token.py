"""A per-server secret, so that nobody but the orchestrator can drive the internal stages: it is the key of
the stage links (backends/ipc/link.py), where one stray ``DecodeAttach`` call would take over the token fan-out.
"""
from __future__ import annotations

import functools
import os
import secrets

from backends.ipc.run_dir import run_dir


@functools.cache
def internal_token() -> str:
    """The server's token (hex), created by whichever process asks first, in the run directory (mode 0600)."""
    path = run_dir() / "internal.token"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _read(path)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(16))
    return _read(path)


def _read(path) -> str:
    # A creator may be between open() and write(): wait for the 32 hex digits.
    for _ in range(1000):
        value = path.read_text().strip()
        if len(value) == 32:
            return value
        os.sched_yield()
    raise RuntimeError(f"{path} holds no token")
