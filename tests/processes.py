"""Processes as the tests look at them (Linux's /proc)."""
from __future__ import annotations

from pathlib import Path


def running(pid: int) -> bool:
    """Whether ``pid`` runs: it exists and is no zombie (exited, not yet reaped by its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
