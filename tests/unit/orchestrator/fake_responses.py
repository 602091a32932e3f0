"""The response part of ``triton_python_backend_utils`` (``Tensor``, ``InferenceResponse``, ``TritonError``, the
final flag) in memory, for unit tests of what the orchestrator sends its clients."""
from __future__ import annotations

import sys
import types

import numpy as np

FINAL = 1  # TRITONSERVER_RESPONSE_COMPLETE_FINAL


class Tensor:
    def __init__(self, name: str, data: np.ndarray):
        self._name, self._data = name, data

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._data


class TritonError:
    INVALID_ARG, INTERNAL, UNAVAILABLE = "INVALID_ARG", "INTERNAL", "UNAVAILABLE"

    def __init__(self, message: str, code: str = "INTERNAL"):
        self.message, self.code = message, code


class InferenceResponse:
    def __init__(self, output_tensors=(), error: TritonError | None = None):
        self.output_tensors, self.error = list(output_tensors), error

    def outputs(self) -> dict:
        """{name: the tensor's values as a Python list (str for text)}."""
        return {t.name(): [v.decode() if isinstance(v, bytes) else v.item() for v in t.as_numpy()]
                for t in self.output_tensors}


def install(monkeypatch) -> None:
    """Make ``triton_python_backend_utils`` importable as this fake for the test."""
    module = types.ModuleType("triton_python_backend_utils")
    module.Tensor, module.InferenceResponse, module.TritonError = Tensor, InferenceResponse, TritonError
    module.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", module)
