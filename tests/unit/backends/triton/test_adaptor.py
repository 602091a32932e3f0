"""Every model.py is the same adaptor; the class comes from the model's name (replicas too)."""
import gc
import json
import sys
from pathlib import Path

import pytest

from backends.stages.decode_stage import DecodeStage
from backends.stages.encode_prefill_stage import EncodePrefillStage
from backends.triton import adaptor
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


def test_the_heap_is_collected_and_frozen_once_the_model_is_built(monkeypatch):
    built = []

    class Model:
        def __init__(self, args):
            built.append([object() for _ in range(100)])  # what a model keeps from its start-up

    monkeypatch.setattr(adaptor, "model_class", lambda name: Model)
    monkeypatch.setattr(adaptor.model_log, "install", lambda name: None)
    monkeypatch.setattr(adaptor.standalone, "adopt", lambda: None)
    callbacks = list(gc.callbacks)
    gc.unfreeze()
    try:
        adaptor.TritonPythonModel().initialize({"model_name": "decode", "model_config": "{}"})
        assert gc.get_freeze_count() > len(built[0])  # its objects, and all before them, are never walked again
        assert len(gc.callbacks) == len(callbacks) + 1  # long collections are logged
    finally:
        gc.unfreeze()
        gc.callbacks[:] = callbacks


@pytest.mark.parametrize("value, interval_s", [("", 0.005), ("0.5", 0.0005), ("1000", 1.0)])
def test_gil_switch_interval_ms_sets_the_process_switch_interval(monkeypatch, value, interval_s):
    monkeypatch.setattr(adaptor, "model_class", lambda name: lambda args: None)
    monkeypatch.setattr(adaptor.model_log, "install", lambda name: None)
    monkeypatch.setattr(adaptor.standalone, "adopt", lambda: None)
    monkeypatch.setattr(adaptor, "watch_collections", lambda name, refreeze: None)
    config = json.dumps({"parameters": {"gil_switch_interval_ms": {"string_value": value}}})
    saved = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        adaptor.TritonPythonModel().initialize({"model_name": "orchestrator", "model_config": config})
        assert sys.getswitchinterval() == pytest.approx(interval_s)
    finally:
        sys.setswitchinterval(saved)
        gc.unfreeze()


@pytest.mark.parametrize("value", ["0", "1001", "1e20", "abc"])
def test_a_gil_switch_interval_out_of_range_is_refused_before_the_model_is_built(monkeypatch, value):
    monkeypatch.setattr(adaptor, "model_class", lambda name: pytest.fail("the model was built"))
    monkeypatch.setattr(adaptor.model_log, "install", lambda name: None)
    monkeypatch.setattr(adaptor.standalone, "adopt", lambda: pytest.fail("a run directory was adopted"))
    config = json.dumps({"parameters": {"gil_switch_interval_ms": {"string_value": value}}})
    with pytest.raises(ValueError, match="gil_switch_interval_ms must be a positive number of at most 1000, got"):
        adaptor.TritonPythonModel().initialize({"model_name": "decode", "model_config": config})


@pytest.mark.parametrize("groups, refused", [
    (None, False), ([{"count": 1, "kind": "KIND_CPU"}], False), ([{"kind": "KIND_CPU"}], False),
    ([{"count": 2, "kind": "KIND_CPU"}], True), ([{"count": 1}, {"count": 1}], True),
])
def test_a_model_refuses_more_than_one_instance_naming_replicas(groups, refused):
    config = json.dumps({} if groups is None else {"instance_group": groups})
    args = {"model_name": "decode", "model_config": config}
    if not refused:
        adaptor.one_instance(args)
        return
    with pytest.raises(ValueError, match="decode: instance_group asks for 2 instances; .* orchestrator.replicas"):
        adaptor.one_instance(args)
