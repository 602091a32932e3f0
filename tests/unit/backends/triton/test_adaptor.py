"""Every model.py is the same adaptor; the class comes from the model's name (replicas too)."""
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backends.stages.decode_stage import DecodeStage
from backends.stages.encode_prefill_stage import EncodePrefillStage
from backends.triton import adaptor
from backends.triton.adaptor import model_class
from backends.triton.launcher import REPO_ROOT
from orchestrator.triton_model import OrchestratorModel


@pytest.fixture(autouse=True)
def run_dir(tmp_path, monkeypatch):
    """The run directory a model process finds named (the launcher's): where its serving lock goes."""
    monkeypatch.setenv("UNIFIEDSERVE_RUN_DIR", str(tmp_path))
    return tmp_path


def test_a_model_that_serves_already_is_refused_a_second_instance_until_it_lets_go(run_dir):
    """Triton's reload with a new configuration starts the new instance beside the old one: its ``serving_lock`` is
    refused, naming what to do, while another process holds the model's past the wait; a holder that lets go within
    it (an instance unloaded just before) hands it over."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "from backends.triton.adaptor import serving_lock; serving_lock('orchestrator'); "
                               "print('held', flush=True); input()"],
        cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "UNIFIEDSERVE_RUN_DIR": str(run_dir)})
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match="orchestrator: another instance of this model still runs in this "
                                             "server after 0.3 s .* unload the model .* then load it"):
            adaptor.serving_lock("orchestrator", wait_s=0.3)
        os.close(adaptor.serving_lock("decode", wait_s=0))  # another model's is its own
        holder.stdin.write("\n")
        holder.stdin.flush()  # the holder exits now, while the next take waits
        os.close(adaptor.serving_lock("orchestrator", wait_s=30))
    finally:
        holder.communicate(timeout=30)


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


def test_a_repository_whose_models_serve_different_models_is_refused_naming_the_key(tmp_path, monkeypatch):
    """A hand-edited repository: decode's seed and model_path (written another way) differ from the other models'.
    Each model refuses to load, naming the key and every model's value; the shipped repository and a copy the
    launcher's --set makes (it sets every model) load."""
    from backends.triton.repository import model_wide_conflicts, parse_overrides, repository_with

    monkeypatch.setattr(adaptor, "model_class", lambda name: pytest.fail("the model was built"))
    monkeypatch.setattr(adaptor.model_log, "install", lambda name: None)
    monkeypatch.setattr(adaptor.standalone, "adopt", lambda: pytest.fail("a run directory was adopted"))
    assert model_wide_conflicts(REPO_ROOT / "model_repository") == []
    copy = repository_with(tmp_path / "set", parse_overrides(["decode.seed=7", "*.model_path=/models/qwen"]))
    assert model_wide_conflicts(copy) == []
    adaptor.one_served_model({"model_name": "decode", "model_repository": str(copy / "decode")})
    config = copy / "decode" / "config.pbtxt"
    text = config.read_text().replace('"seed" value { string_value: "7" }', '"seed" value { string_value: "8" }')
    config.unlink()  # the copy links the shipped files: write decode's own
    config.write_text(text)
    (conflict,) = model_wide_conflicts(copy)
    assert conflict.startswith("seed: ") and "decode '8'" in conflict and "encode_prefill '7'" in conflict
    with pytest.raises(ValueError, match=r"encode_prefill: the models of .* must serve one model, but they set seed: "):
        adaptor.TritonPythonModel().initialize({"model_name": "encode_prefill", "model_config": "{}",
                                                "model_repository": str(copy / "encode_prefill")})
    text = config.read_text().replace('"seed" value { string_value: "8" }', '"seed" value { string_value: "7" }')
    config.write_text(text.replace('string_value: "/models/qwen"', 'string_value: "/models//qwen/"'))
    assert model_wide_conflicts(copy) == []  # the same path written another way
