"""The one body of every ``model_repository/<model>/1/model.py``: a Triton Python model that hands
``initialize``, ``execute`` and ``finalize`` to a class of ours, chosen by the model's name, so the model files
hold no logic.

The class is imported in ``initialize`` (the stub imports ``model.py`` before it knows which model it serves) and
built from Triton's ``args``; it has ``execute(requests)`` (a list of responses, or None for a decoupled model)
and ``finalize()``. A stage replica's model (``decode_r1``, ``backends.triton.replicas``) is its stage's class.
"""
from __future__ import annotations

import importlib
import re

MODELS = {
    "orchestrator": "orchestrator.triton_model:OrchestratorModel",
    "flashcodec": "backends.stages.flashcodec_stage:FlashCodecStage",
    "encode_prefill": "backends.stages.encode_prefill_stage:EncodePrefillStage",
    "decode": "backends.stages.decode_stage:DecodeStage",
}


def model_class(model_name: str) -> type:
    """The class serving Triton model ``model_name``; raises KeyError for a model that is not ours."""
    module_name, class_name = MODELS[re.sub(r"_r\d+$", "", model_name)].split(":")
    return getattr(importlib.import_module(module_name), class_name)


class TritonPythonModel:
    def initialize(self, args):
        self.model = model_class(args["model_name"])(args)

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.finalize()
