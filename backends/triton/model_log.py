"""Our packages' log records in the server log, one tagged line each: ``unifiedserve[MODEL] LEVEL message``.

A model process's stderr is the server's log (the stub inherits it). Without a handler, Python would print only
warnings, untagged; with this one, each stage's INFO lines (what it is loading, capturing or compiling) appear too,
and the launcher shows what a model that takes long to load is doing (``backends.triton.load_progress``). Only our
packages' loggers get the handler: torch's and transformers' INFO records stay quiet.
"""
from __future__ import annotations

import logging
import re
import sys
from typing import TextIO

PACKAGES = ("backends", "orchestrator", "flashcodec")
_LINE = re.compile(r"^unifiedserve\[(?P<model>[^\]\s]+)\] (?P<level>[A-Z]+) (?P<message>.*)$")


def install(model: str, stream: TextIO | None = None) -> logging.Handler:
    """Send our packages' records of level INFO and above to ``stream`` (default: stderr), tagged with ``model``
    (a Triton model name). Records no longer reach the root logger. Returns the handler (installed once per
    process: a second call replaces the first)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter(f"unifiedserve[{model}] %(levelname)s %(message)s"))
    handler.set_name("unifiedserve-model-log")
    for name in PACKAGES:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if h.get_name() == handler.get_name()]:
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return handler


def parse(line: str) -> tuple[str, str, str] | None:
    """(model, level, message) of a line written by :func:`install`'s handler; None for any other line."""
    match = _LINE.match(line.rstrip("\n"))
    return (match["model"], match["level"], match["message"]) if match else None
