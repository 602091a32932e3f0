"""The decode stage's speed options: checked before the model loads, and what "auto" picks on a CPU."""
import pytest
import torch

from backends import shared_tensor
from backends.runtime.loader import ModelSpec
from backends.stages.decode_worker import DecodeWorker


@pytest.fixture(autouse=True)
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(shared_tensor.RUN_DIR_ENV, str(tmp_path))


@pytest.mark.parametrize("option", ["cuda_graphs", "compile_layers"])
def test_options_name_the_bad_value(option):
    with pytest.raises(ValueError, match=f"{option} must be auto, on or off, got 'yes'"):
        DecodeWorker(ModelSpec(), torch.device("cpu"), kv_pages=8, page_size=16, max_batch=4, **{option: "yes"})


def test_auto_on_the_cpu_is_eager(caplog):
    """No flashinfer on the CPU: no CUDA graphs, so no compiled layers either (nothing to amortise a compile)."""
    caplog.set_level("INFO", logger="backends.stages.decode_worker")
    worker = DecodeWorker(ModelSpec(), torch.device("cpu"), kv_pages=8, page_size=16, max_batch=4)
    try:
        assert worker.runner.graphs is None
        assert "CUDA graphs off, decoder layers eager" in caplog.text
    finally:
        worker.shutdown()


def test_next_step_layout_is_planned_as_the_step_will_run():
    """What the worker plans ahead during a step (``_next_layout``): the batch it will step next if no sequence
    ends with an eos token: those reaching ``max_tokens`` leave, the stepped ones hold one more token, and a
    sequence that waited for room takes a freed row."""
    import numpy as np

    from backends.runtime.sampler import SamplingParams
    from backends.stages.decode_worker import RunningSeq

    worker = DecodeWorker(ModelSpec(), torch.device("cpu"), kv_pages=8, page_size=16, max_batch=2)
    try:  # no stream attached: the loop thread waits for commands and leaves `running` alone
        seqs = [RunningSeq(name, np.array([i], dtype=np.int32), 10 * (i + 1), 5, 0, generated, 5, SamplingParams())
                for i, (name, generated) in enumerate((("a", 4), ("b", 1), ("c", 0)))]
        worker.running = {s.seq_id: s for s in seqs}
        layout = worker._next_layout(seqs[:2])  # "a" makes its 5th and last token this step
        assert [(d.num_cached, d.block_table) for d in layout] == [(21, seqs[1].block_table), (30, seqs[2].block_table)]
        seqs[0].num_generated = 0
        assert [d.num_cached for d in worker._next_layout(seqs[:2])] == [11, 21]  # full: "c" still waits
    finally:
        worker.shutdown()
