"""The decode loop and the KV pages granted as a reply grows (``DecodeGrow``, ``orchestrator.kv_growth``): a
sequence steps only while its block table has a page for its next token's KV."""
import time

import pytest

from tests.unit.backends.stages.test_decode_worker_steps import admit, alone, attach_queue, collect, worker_on
from tests.unit.backends.stages.test_decode_worker_steps import run_dir  # noqa: F401 (autouse: the run directory)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_sequence_out_of_pages_waits_for_a_page_then_goes_on(device):
    """A sequence whose block table is full is left out of the steps (none is launched that would write past it),
    and the loop idles, until ``grow`` appends a page (``DecodeGrow``); then it goes on with the tokens it makes
    alone on both pages. A page for a sequence decode no longer holds is ignored. The step before the wait tells
    the stage's metrics the worker is idle (so they are sent, not held over the wait)."""
    worker = worker_on(device, max_batch=2)
    try:
        reference = alone(worker, first=5, page=[1, 2], steps=24)
        worker.eos_ids = []
        steps = attach_queue(worker)
        told = []
        worker.on_step = lambda batch, elapsed, idle: told.append((batch, idle))
        admit(worker, "a", 5, [1], max_tokens=24)
        made = []
        while len(made) < 16:  # its page holds positions 0-15: the KV of 16 tokens
            made += steps.get(timeout=60)[1]
        time.sleep(0.3)
        assert steps.empty() and made == reference[:16] and worker.running["a"].num_cached == 16
        assert told[-1] == (1, True) and not told[0][1]  # idle once its table is full
        worker.grow((("gone", (3,)), ("a", (2,))))
        tokens, reasons, _ = collect(steps, ["a"])
        assert made + tokens["a"] == reference and reasons["a"] == "length"
    finally:
        worker.shutdown()
