"""Triton adaptor: the model's class is chosen by its name in backends/triton/adaptor.py."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))  # the repo root; the stub ignores PYTHONPATH
from backends.triton.adaptor import TritonPythonModel  # noqa: E402,F401
