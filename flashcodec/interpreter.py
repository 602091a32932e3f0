"""The Python interpreter for helper processes (FlashCodec's decoder workers and NVDEC helpers, the vision
tensor-parallel ranks). Inside Triton's Python-backend stub `sys.executable` is the stub binary, so helpers are
started as `python -m module` with the interpreter found here. Imports nothing heavy (no PyAV, no torch)."""
from __future__ import annotations

import os
import shutil
import sys


class NoInterpreter(RuntimeError):
    """No usable python3 was found."""


def python_executable() -> str:
    """The interpreter for helper processes: `sys.executable` when it is a python, else `python3` in the running
    interpreter's prefix (a venv's, then the base one), else `python3` on PATH. Raises NoInterpreter."""
    candidates = [sys.executable] if os.path.basename(sys.executable or "").startswith("python") else []
    candidates += [os.path.join(prefix, "bin", "python3") for prefix in (sys.prefix, sys.base_prefix)]
    candidates.append(shutil.which("python3") or "")
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise NoInterpreter("no python3 interpreter found for the helper processes")
