"""The decode stage's speed options: checked before the model loads, and what "auto" picks on a CPU."""
import pytest
import torch

from backends.ipc.run_dir import RUN_DIR_ENV
from backends.runtime.loader import ModelSpec
from backends.stages.decode_worker import DecodeWorker


@pytest.fixture(autouse=True)
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))


@pytest.mark.parametrize("option", ["cuda_graphs", "compile_layers", "overlap_steps"])
def test_options_name_the_bad_value(option):
    with pytest.raises(ValueError, match=f"{option} must be auto, on or off, got 'yes'"):
        DecodeWorker(ModelSpec(), torch.device("cpu"), kv_pages=8, page_size=16, max_batch=4, **{option: "yes"})


def test_auto_on_the_cpu_is_eager(caplog):
    """No flashinfer on the CPU: no CUDA graphs, so no compiled layers either (nothing to amortise a compile) and
    no overlapped steps (each message would come a step later, for nothing)."""
    caplog.set_level("INFO", logger="backends.stages.decode_worker")
    worker = DecodeWorker(ModelSpec(), torch.device("cpu"), kv_pages=8, page_size=16, max_batch=4)
    try:
        assert worker.runner.graphs is None
        assert not worker.overlap
        assert "CUDA graphs off, decoder layers eager, steps one at a time" in caplog.text
    finally:
        worker.shutdown()
