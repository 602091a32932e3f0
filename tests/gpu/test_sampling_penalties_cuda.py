"""Penalties on CUDA: the same penalized logits as on the CPU for Qwen2.5-VL's vocabulary (first tokens, and the
decode stage's per-sequence counts over steps with sequences joining and leaving), no device->host sync in a decode
step's penalize + sample + count or in an admission, and the decode stage (flashinfer, CUDA graphs, overlapped
steps) streaming the greedy tokens of a penalized sequence stepped alone with the reference penalties.

Run on the device: `python3 -m pytest -q -m gpu tests/gpu/test_sampling_penalties_cuda.py` (skipped without CUDA).
"""
import random

import pytest
import torch

from backends.ipc.protocol import SamplingParams
from backends.runtime.sampling.penalties import PenaltyState, penalize_first_tokens
from backends.runtime.sampling.sampler import sample_tensor, warm_up
from tests.unit.backends.stages.test_decode_penalties import admit, alone
# run_dir: that module's autouse fixture (each worker's own run directory), used here too
from tests.unit.backends.stages.test_decode_worker_steps import (  # noqa: F401
    attach_queue, collect, expected, run_dir, worker_on)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
VOCAB = 151_936  # Qwen2.5-VL's
EOS = [151_643, 151_645]
CLOSE = dict(rtol=1e-6, atol=1e-6)  # IEEE division and multiplication round alike on both devices


def _params(i: int) -> SamplingParams:
    return SamplingParams(temperature=[0, 0.8][i % 2], seed=i, repetition_penalty=[1.0, 1.3, 0.8, 2.0][i % 4],
                          presence_penalty=[0.0, 0.5, -1.0][i % 3], frequency_penalty=[0.0, 0.25, 1.5, -0.5][i % 4])


def test_first_tokens_on_cuda_equal_cpu():
    rng = random.Random(0)
    logits = torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    prompts = [tuple(rng.randrange(VOCAB) for _ in range(rng.randrange(1, 3000))) for _ in range(64)]
    params = [_params(i) for i in range(64)]
    cpu = penalize_first_tokens(logits, prompts, params)
    torch.testing.assert_close(penalize_first_tokens(logits.cuda(), prompts, params).cpu(), cpu, **CLOSE)
    assert not torch.equal(cpu, logits)


def test_decode_counts_on_cuda_equal_cpu():
    """The same admissions, batches and tokens on both devices: every step's penalized logits agree."""
    rng = random.Random(1)
    states = {d: PenaltyState(VOCAB, torch.device(d)) for d in ("cpu", "cuda")}
    live: dict[str, SamplingParams] = {}
    for step in range(30):
        for _ in range(rng.randrange(0, 6)):
            seq_id = f"s{step}-{len(live)}"
            live[seq_id] = _params(rng.randrange(64))
            prompt = tuple(sorted({rng.randrange(VOCAB) for _ in range(rng.randrange(1, 500))}))
            output = (rng.randrange(VOCAB),)  # drawn once: both devices get the same sequence
            for state in states.values():
                state.retain(live)
                state.add(seq_id, live[seq_id], prompt, output)
        if not live:
            continue
        batch = rng.sample(sorted(live), min(len(live), 48))
        logits = torch.randn(len(batch), VOCAB, generator=torch.Generator().manual_seed(step)) * 4
        cpu, cpu_rows = states["cpu"].penalize(logits, batch)
        cuda, cuda_rows = states["cuda"].penalize(logits.cuda(), batch)
        torch.testing.assert_close(cuda.cpu(), cpu, **CLOSE)
        tokens = cpu.argmax(dim=-1)
        states["cpu"].count(cpu_rows, tokens)
        states["cuda"].count(cuda_rows, tokens.cuda())
        for seq_id in rng.sample(sorted(live), min(len(live), rng.randrange(0, 4))):
            del live[seq_id]
    assert torch.equal(states["cuda"].counts.cpu(), states["cpu"].counts)


def test_no_sync_in_a_penalized_step_or_an_admission():
    warm_up(torch.device("cuda"), VOCAB)
    state = PenaltyState(VOCAB, torch.device("cuda"))
    params = [_params(i) for i in range(64)]
    logits = (torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(2)) * 4).cuda()
    seq_ids = [f"s{i}" for i in range(64)]

    def step_and_admit():
        penalized, rows = state.penalize(logits, seq_ids)
        tokens = sample_tensor(penalized, params, [3] * 64, EOS)
        state.count(rows, tokens)
        state.retain(seq_ids[1:])
        state.add("s0", params[1], tuple(range(0, 4000, 3)), (7,))
        return sample_tensor(penalize_first_tokens(logits, [tuple(range(100))] * 64, params), params, [0] * 64, EOS)

    for i, p in enumerate(params):
        state.add(seq_ids[i], p, (1, 2, 3), (4,))
    step_and_admit()  # warm the caches (token hash, pinned memory, the tables at their size)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step_and_admit()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_decode_stage_with_penalties_on_cuda_streams_the_reference_tokens():
    """One penalized sequence (the same CUDA graph alone and in the stage), its counts updated on the device while
    the next step is already launched."""
    worker = worker_on("cuda", max_batch=2)
    try:
        params = SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.5)
        plain = alone(worker, 5, 1, 15, SamplingParams(temperature=0), [])
        prompt = plain[:4] + [1, 2]
        reference = alone(worker, 5, 1, 15, params, prompt)
        assert reference != plain
        worker.eos_ids = []
        steps = attach_queue(worker)
        admit(worker, "a", 5, 1, 15, params, prompt)
        tokens, reasons, _ = collect(steps, ["a"])
        assert (tokens["a"], reasons["a"]) == expected(reference, 14, [])
    finally:
        worker.shutdown()
