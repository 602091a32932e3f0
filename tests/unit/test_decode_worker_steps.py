"""The decode stage's loop with overlapped steps (``backends/stages/decode_worker.py``): step N+1 is launched
with step N's tokens still on the device, yet every sequence streams exactly the tokens that stepping it alone
gives, ends where the stop rule says, and sends nothing after its last message. Runs on the CPU (tiny model,
torch backend) and, where there is a GPU, on CUDA with flashinfer and CUDA graphs (one sequence: the same graph
with and without overlap, so the same bits)."""
import queue
import time

import numpy as np
import pytest
import torch

from backends import shared_tensor
from backends.runtime.loader import ModelSpec
from backends.runtime.model_runner import DecodeSeq
from backends.runtime.sampler import SamplingParams
from backends.stages.decode_worker import DecodeWorker, RunningSeq

GREEDY = {"temperature": 0.0}


@pytest.fixture(autouse=True)
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(shared_tensor.RUN_DIR_ENV, str(tmp_path))


def worker_on(device: str, max_batch: int) -> DecodeWorker:
    if device == "cpu":
        return DecodeWorker(ModelSpec(), torch.device("cpu"), kv_pages=8, page_size=16, max_batch=max_batch)
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("flashinfer")
    return DecodeWorker(ModelSpec(dtype="bfloat16", device="cuda"), torch.device("cuda"), kv_pages=8,
                        page_size=16, max_batch=max_batch, cuda_graphs="on")


def alone(worker: DecodeWorker, first: int, page: int, steps: int) -> list[int]:
    """Greedy tokens of one sequence stepped alone from an empty cache, each step read before the next."""
    tokens, token = [], first
    for n in range(steps):
        logits = worker.runner.decode([DecodeSeq(token, n, n, np.array([page], dtype=np.int32))])
        token = int(logits.argmax(dim=-1)[0])
        tokens.append(token)
    return tokens


def admit(worker: DecodeWorker, seq_id: str, first: int, page: int, max_tokens: int) -> None:
    worker.admit({"seq_id": seq_id, "block_table": [page], "num_cached": 0, "last_token": first, "mrope_delta": 0,
                  "num_generated": 0, "max_tokens": max_tokens, "sampling": GREEDY})


def attach_queue(worker: DecodeWorker) -> queue.Queue:
    """Attach a sink that puts each step's message ``(seq_ids, tokens, reasons)`` on the returned queue."""
    steps: queue.Queue = queue.Queue()
    worker.attach(lambda ids, tokens, reasons: steps.put((ids, tokens, reasons)), lambda: None)
    return steps


def collect(steps: queue.Queue, seq_ids: list[str]) -> tuple[dict[str, list[int]], dict[str, str], dict[str, int]]:
    """Each sequence's streamed tokens and finish reason, read until all have ended (queue.Empty after 60 s),
    and how many rows each sent after its last message."""
    tokens = {s: [] for s in seq_ids}
    reasons: dict[str, str] = {}
    after_end: dict[str, int] = {}
    deadline = time.monotonic() + 60
    while len(reasons) < len(seq_ids):
        ids, out, why = steps.get(timeout=max(0.1, deadline - time.monotonic()))
        for seq_id, token, reason in zip(ids, out, why):
            if seq_id in reasons:
                after_end[seq_id] = after_end.get(seq_id, 0) + 1
            tokens[seq_id].append(token)
            if reason:
                reasons[seq_id] = reason
    return tokens, reasons, after_end


def expected(reference: list[int], max_tokens: int, eos: int) -> tuple[list[int], str]:
    """The stop rule applied to a sequence's tokens made alone: up to the first eos, or ``max_tokens``."""
    for i, token in enumerate(reference[:max_tokens]):
        if token == eos:
            return reference[:i + 1], "stop"
    return reference[:max_tokens], "length"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_an_eos_ending_with_the_next_step_in_flight(device):
    """One sequence ends with an eos token while the step after is already launched: its tokens are those of
    the sequence stepped alone up to the eos, and nothing follows its last message."""
    worker = worker_on(device, max_batch=2)
    try:
        reference = alone(worker, first=5, page=1, steps=12)
        eos = reference[6]
        worker.eos_ids = [eos]
        steps = attach_queue(worker)
        admit(worker, "a", 5, 1, max_tokens=12)
        tokens, reasons, after_end = collect(steps, ["a"])
        assert (tokens["a"], reasons["a"]) == expected(reference, 12, eos)
        time.sleep(0.2)  # a dropped row would have been sent by now
        assert steps.empty() and not after_end and not worker.running
    finally:
        worker.shutdown()


def test_mixed_ends_and_a_sequence_waiting_for_a_row():
    """Three sequences, two rows: one ends by eos, one by max_tokens, and the third, waiting for a free row,
    joins the batch (its token on the host while the others' are on the device). Each streams what it makes
    alone, up to its end. The one ending by max_tokens fills its only page: a step launched after its last
    token would not fit there (the step fails)."""
    worker = worker_on("cpu", max_batch=2)
    try:
        firsts, pages, limits = {"a": 5, "b": 9, "c": 13}, {"a": 1, "b": 2, "c": 3}, {"a": 10, "b": 16, "c": 7}
        references = {s: alone(worker, firsts[s], pages[s], 16) for s in firsts}
        eos = references["a"][5]
        worker.eos_ids = [eos]
        steps = attach_queue(worker)
        for s in firsts:
            admit(worker, s, firsts[s], pages[s], limits[s])
        tokens, reasons, after_end = collect(steps, list(firsts))
        for s in firsts:
            assert (tokens[s], reasons[s]) == expected(references[s], limits[s], eos), s
        time.sleep(0.2)
        assert steps.empty() and not after_end and not worker.running
    finally:
        worker.shutdown()


def test_next_step_layout_is_the_batch_as_it_will_run():
    """What the worker plans ahead (``_next_layout``): the running sequences with a token left to make, holding
    what the steps launched so far will have cached, at most ``max_batch``; a sequence whose last token is in
    flight leaves, and one that waited for room takes its row."""
    worker = DecodeWorker(ModelSpec(), torch.device("cpu"), kv_pages=8, page_size=16, max_batch=2)
    try:  # no stream attached: the loop thread waits for commands and leaves `running` alone
        seqs = [RunningSeq(name, np.array([i], dtype=np.int32), 10 * (i + 1), 5, 0, 1, 5, SamplingParams(),
                           ending=ending) for i, (name, ending) in enumerate((("a", True), ("b", False), ("c", False)))]
        worker.running = {s.seq_id: s for s in seqs}
        layout = worker._next_layout()
        assert [(d.num_cached, d.block_table) for d in layout] == [(20, seqs[1].block_table), (30, seqs[2].block_table)]
        seqs[0].ending = False
        assert [d.num_cached for d in worker._next_layout()] == [10, 20]  # full: "c" waits
    finally:
        worker.shutdown()
