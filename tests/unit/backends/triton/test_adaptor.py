"""Every model.py is the same adaptor; the class comes from the model's name (replicas too)."""
from pathlib import Path

import pytest

from backends.stages.decode_stage import DecodeStage
from backends.stages.encode_prefill_stage import EncodePrefillStage
from backends.triton.adaptor import model_class
from backends.triton.launcher import REPO_ROOT
from orchestrator.triton_model import OrchestratorModel


def test_the_class_follows_the_model_name_and_replicas_share_their_stage_class():
    assert model_class("orchestrator") is OrchestratorModel
    assert model_class("decode") is model_class("decode_r3") is DecodeStage
    assert model_class("encode_prefill_r1") is EncodePrefillStage
    with pytest.raises(KeyError):
        model_class("somebody_elses_model")


def test_every_model_file_is_the_one_adaptor():
    files = sorted((REPO_ROOT / "model_repository").glob("*/1/model.py"))
    assert len(files) == 4 and len({Path(f).read_text() for f in files}) == 1
