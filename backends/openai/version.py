"""The ``unifiedserve`` project's version, as the OpenAI API's ``/version`` answers it."""
from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path


def _version() -> str:
    """The ``unifiedserve`` project's version: its installed metadata, or in a checkout run in place (not installed:
    ``make test``) pyproject.toml's ``version`` line."""
    try:
        return importlib.metadata.version("unifiedserve")
    except importlib.metadata.PackageNotFoundError:
        pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
        return re.search(r'^version = "([^"]+)"$', pyproject, re.MULTILINE).group(1)


VERSION = _version()
