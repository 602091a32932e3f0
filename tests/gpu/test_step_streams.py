"""encode_prefill's step streams (``backends/stages/step_streams.py``) on the GPU, with a real CUDA green context:

* inside ``for_step(True)`` the green context's stream is the current one, inside ``for_step(False)`` the ordinary
  (default) stream;
* one prompt prefilled in chunks whose steps alternate between the green stream and the ordinary one (as steps
  the orchestrator marks ``fewer_sms`` and others), no step waiting for the device, gives the logits and the KV of
  the same chunks all on the ordinary stream: eager with the torch attention backend (float32), and with flashinfer
  and prefill CUDA graphs (bf16; the graphs captured on the green stream, as the worker's first step may, and
  replayed on both; a long chunk's FA3 in row groups sized to the green context's SMs).

A missed wait between the streams shows as a chunk reading KV the last one has not written yet. Skipped without CUDA
(or flashinfer, for its case), and where the installed torch's ``GreenContext`` lacks ``Stream`` (the reason given).
Run on the device by bench/device_run.sh, gpu-tests.
"""
from __future__ import annotations

import pytest
import torch

from backends.runtime.language_model.kv_cache import pages_needed
from backends.stages.step_streams import StepStreams
from tests.gpu.test_flashinfer_runtime import DEVICE, RTOL, paged_runner, rel_err
from tests.gpu.test_prefill_graphs import chunk, token_ids

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
SMS = 16  # of the H200's 132
# one step a chunk: eager (> 512) and graphed ones; the last, 9 FA3 tiles of the tiny model's 192 rows x 2 heads, in
# two row groups on the green context's 16 SMs (backends/runtime/attention/sm_partition.py)
BOUNDS = [0, 700, 1000, 1017, 1529, 1800, 2333, 4000]
STREAMS = [True, False, True, True, False, True, True]  # each step marked fewer_sms or not


def green_streams() -> StepStreams:
    try:
        return StepStreams(DEVICE, SMS)
    except ValueError as exc:  # a torch whose GreenContext has no Stream
        pytest.skip(str(exc))


def test_the_green_stream_is_current_in_a_fewer_sms_step():
    streams = green_streams()
    with streams.for_step(True):
        assert torch.cuda.current_stream(DEVICE) == streams.green
    with streams.for_step(False):
        assert torch.cuda.current_stream(DEVICE) == torch.cuda.default_stream(DEVICE)
    assert torch.cuda.current_stream(DEVICE) == torch.cuda.default_stream(DEVICE)


def _steps(runner, streams: StepStreams, fewer: list[bool], ids: list[int], table: list[int]) -> list[torch.Tensor]:
    """The prompt's chunks, one step each on the stream ``fewer`` picks, with no wait for the device between them;
    each chunk's last-token logits (float32 ``[vocab]``), read once every step is queued."""
    out = []
    for start, end, fewer_sms in zip(BOUNDS, BOUNDS[1:], fewer):
        runner.backend.sms_limit = streams.step_sms(fewer_sms)  # as the worker sets it
        with streams.for_step(fewer_sms):
            out.append(runner.prefill([chunk(runner, ids[start:end], start, table)])[0])
    with streams.for_step(False):  # the ordinary stream, after the green one
        return [logits.cpu() for logits in out]


@pytest.mark.parametrize("backend, dtype, graphs, tolerance", [("torch", torch.float32, False, 1e-4),
                                                               ("flashinfer", torch.bfloat16, True, RTOL)])
def test_chunks_alternating_between_the_streams_equal_one_stream(backend, dtype, graphs, tolerance):
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    streams = green_streams()
    pages = pages_needed(BOUNDS[-1], 16)
    runner = paged_runner("tiny", backend, dtype, pages=2 * pages + 1)
    if graphs:
        with streams.for_step(True):
            runner.enable_prefill_graphs()
    ids = token_ids(BOUNDS[-1], 19)
    one, alternating = list(range(pages)), list(range(pages, 2 * pages))
    expected = _steps(runner, streams, [False] * len(STREAMS), ids, one)
    got = _steps(runner, streams, STREAMS, ids, alternating)
    errors = [rel_err(g, e) for g, e in zip(got, expected)]
    assert max(errors) < tolerance, errors
    kv = runner.kv_cache
    assert rel_err(kv[:, :, alternating], kv[:, :, one]) < tolerance
