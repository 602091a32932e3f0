"""The project installed as pip installs it (`pip install .`), into a folder of its own, for the tests of what an
installed client can do from any folder."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backends.triton.launcher import REPO_ROOT

PACKAGES = ("backends", "client", "flashcodec", "orchestrator")  # pyproject.toml's [tool.setuptools.packages.find]


def build_wheel(work: Path) -> Path:
    """``pip wheel --no-deps`` of a copy of the sources (the checkout gets no build/ folder); returns the wheel.
    Uses this interpreter's setuptools (no build isolation: no index is needed); skips the test without it."""
    pytest.importorskip("setuptools", reason="building the wheel offline needs setuptools in this interpreter")
    source = work / "source"
    source.mkdir(parents=True)
    shutil.copy2(REPO_ROOT / "pyproject.toml", source)
    for package in PACKAGES:
        shutil.copytree(REPO_ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(work / "dist"), str(source)], check=True)
    (wheel,) = (work / "dist").glob("unifiedserve-*.whl")
    return wheel


def install(wheel: Path, target: Path) -> Path:
    """``pip install --no-deps --target`` of ``wheel`` (its dependencies are this interpreter's); returns the
    folder, which holds the packages and ``bin/`` with the console commands."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target),
                    str(wheel)], check=True)
    return target


def environment(target: Path) -> dict[str, str]:
    """This process's environment with ``target`` (an :func:`install` folder) first on PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(target), os.environ.get("PYTHONPATH")) if p)}
