"""The decode stage's loop with overlapped steps (``backends/stages/decode_worker.py``): step N+1 is launched
with step N's tokens still on the device, yet every sequence streams exactly the tokens that stepping it alone
gives, ends where the stop rule says, and sends nothing after its last message. Runs on the CPU (tiny model,
torch backend) and, where there is a GPU, on CUDA with flashinfer and CUDA graphs (one sequence: the same graph
with and without overlap, so the same bits)."""
import queue
import random
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from backends.ipc.run_dir import RUN_DIR_ENV
from backends.runtime.loader import ModelSpec
from backends.runtime.model_runner import DecodeSeq
from backends.ipc.protocol import DecodeAdmit, SamplingParams
from backends.runtime.sampling.token_readback import TokenReadback
from backends.stages import decode_worker
from backends.stages.decode_worker import DecodeWorker, RunningSeq

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(autouse=True)
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))


def worker_on(device: str, max_batch: int) -> DecodeWorker:
    if device == "cpu":  # overlapped steps on the CPU too ("auto" keeps them for CUDA graphs): the same loop
        return DecodeWorker(ModelSpec(), torch.device("cpu"), kv_pages=8, page_size=16, max_batch=max_batch,
                            overlap_steps="on")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("flashinfer")
    return DecodeWorker(ModelSpec(dtype="bfloat16", device="cuda"), torch.device("cuda"), kv_pages=8,
                        page_size=16, max_batch=max_batch, cuda_graphs="on")


def alone(worker: DecodeWorker, first: int, page: int | list[int], steps: int) -> list[int]:
    """Greedy tokens of one sequence stepped alone from an empty cache, each step read before the next."""
    tokens, token, table = [], first, np.array(page if isinstance(page, list) else [page], dtype=np.int32)
    for n in range(steps):
        logits = worker.runner.decode([DecodeSeq(token, n, n, table)])
        token = int(logits.argmax(dim=-1)[0])
        tokens.append(token)
    return tokens


def admit(worker: DecodeWorker, seq_id: str, first: int, pages: int | list[int], max_tokens: int) -> None:
    """Admit a sequence with an empty cache and ``first`` as its last token (before :func:`attach_queue`, the
    sequences admitted start in one step)."""
    worker.admit(DecodeAdmit(seq_id, tuple(pages) if isinstance(pages, list) else (pages,), 0, first, 0, 0,
                             max_tokens, GREEDY))


def attach_queue(worker: DecodeWorker) -> queue.Queue:
    """Attach a sink that puts each step's message ``(seq_ids, tokens, reasons)`` on the returned queue."""
    steps: queue.Queue = queue.Queue()
    worker.attach(lambda step: steps.put((list(step.seq_ids), list(step.token_ids), list(step.finish_reasons))),
                  lambda: None)
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


def expected(reference: list[int], max_tokens: int, eos_ids: list[int]) -> tuple[list[int], str]:
    """The stop rule applied to a sequence's tokens made alone: up to the first eos, or ``max_tokens``."""
    for i, token in enumerate(reference[:max_tokens]):
        if token in eos_ids:
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
        assert (tokens["a"], reasons["a"]) == expected(reference, 12, [eos])
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
            assert (tokens[s], reasons[s]) == expected(references[s], limits[s], [eos]), s
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
        seqs = [RunningSeq(name, np.array([2 * i, 2 * i + 1], dtype=np.int32), 10 * (i + 1), 5, 0, 1, 5, GREEDY,
                           ending=ending) for i, (name, ending) in enumerate((("a", True), ("b", False), ("c", False)))]
        worker.running = {s.seq_id: s for s in seqs}
        layout = worker._next_layout()
        assert [(d.num_cached, d.block_table) for d in layout] == [(20, seqs[1].block_table), (30, seqs[2].block_table)]
        seqs[0].ending = False
        assert [d.num_cached for d in worker._next_layout()] == [10, 20]  # full: "c" waits
    finally:
        worker.shutdown()


def test_a_sequence_leaving_an_early_row_while_the_others_go_on():
    """The first row's sequence ends (max_tokens) and nobody joins: the next steps gather the other rows' tokens
    from the step in flight (rows 1 and 2 of 3), not its first rows."""
    worker = worker_on("cpu", max_batch=3)
    try:
        firsts, limits = {"a": 5, "b": 9, "c": 13}, {"a": 2, "b": 8, "c": 8}
        references = {s: alone(worker, firsts[s], i + 1, 8) for i, s in enumerate(firsts)}
        worker.eos_ids = []
        for i, s in enumerate(firsts):
            admit(worker, s, firsts[s], i + 1, limits[s])
        tokens, reasons, _ = collect(attach_queue(worker), list(firsts))
        assert tokens == {s: references[s][:limits[s]] for s in firsts}
        assert set(reasons.values()) == {"length"}
    finally:
        worker.shutdown()


@dataclass(frozen=True)
class _Watched(decode_worker.Launched):
    """A launched step that stays pending, as on a GPU running behind the host, until the host waits for its tokens
    (or a later step's: one stream runs them in order)."""

    def __post_init__(self) -> None:
        _PENDING.append(self)


_PENDING: list = []


class _PendingReadback(TokenReadback):
    def wait(self) -> None:
        for i, step in enumerate(_PENDING):
            if step.tokens is self:
                del _PENDING[:i + 1]
                break


def test_no_last_message_or_abort_while_a_pending_step_holds_the_sequence(monkeypatch):
    """With steps pending until waited for (a GPU behind the host), the orchestrator is never told that a sequence
    ended (it frees the pages then), nor an abort done, while a launched step not yet run holds that sequence; and
    each sequence streams its tokens made alone. Seven sequences, three rows, eos and max_tokens endings, aborts."""
    monkeypatch.setattr(decode_worker, "Launched", _Watched)
    monkeypatch.setattr(decode_worker, "TokenReadback", _PendingReadback)
    _PENDING.clear()
    rng = random.Random(1)
    worker = worker_on("cpu", max_batch=3)
    violations = []

    def held(seq_id: str) -> bool:
        return any(any(s.seq_id == seq_id for s in step.seqs) for step in _PENDING)

    post = worker._post

    def checked_post(send, *args):  # on the loop thread, as the worker posts
        if send is worker.sink:
            violations.extend(("ended", i) for i, r in zip(args[0].seq_ids, args[0].finish_reasons) if r and held(i))
        post(send, *args)

    try:
        firsts = {f"s{i}": rng.randrange(3, 200) for i in range(7)}
        pages = {s: i + 1 for i, s in enumerate(firsts)}
        references = {s: alone(worker, firsts[s], pages[s], 14) for s in firsts}
        worker.eos_ids = [references["s0"][4], references["s3"][2], references["s5"][7]]
        worker._post = checked_post
        limits = {s: rng.randrange(1, 15) for s in firsts}
        for s in firsts:
            admit(worker, s, firsts[s], pages[s], limits[s])
        steps = attach_queue(worker)
        aborted = threading.Event()
        worker.abort("s1", lambda: (violations.extend([("aborted", "s1")] if held("s1") else []), aborted.set()))
        assert aborted.wait(10)
        tokens, reasons, after_end = collect(steps, [s for s in firsts if s != "s1"])
        for s in reasons:
            assert (tokens[s], reasons[s]) == expected(references[s], limits[s], worker.eos_ids), s
        assert not violations and not after_end
    finally:
        worker.shutdown()


def test_a_failed_launch_still_sends_the_step_in_flight():
    """A step that fails to launch with another in flight: the one in flight is read and sent (a sequence whose
    last token it made ends with "length", not "error"), then the rest of the batch fails."""
    worker = worker_on("cpu", max_batch=2)
    decode, calls = worker.runner.decode, []

    def failing_fourth(seqs, token_ids=None):
        calls.append(len(seqs))
        if len(calls) == 4:  # "a"'s third and last token is in flight
            raise RuntimeError("injected launch failure")
        return decode(seqs, token_ids)

    try:
        reference = alone(worker, 5, 1, 3)
        worker.eos_ids = []
        worker.runner.decode = failing_fourth
        admit(worker, "a", 5, 1, max_tokens=3)
        admit(worker, "b", 9, 2, max_tokens=10)
        tokens, reasons, _ = collect(attach_queue(worker), ["a", "b"])
        assert (tokens["a"], reasons["a"]) == (reference, "length")
        assert reasons["b"] == "error" and tokens["b"][-1] == -1 and len(tokens["b"]) == 4
    finally:
        worker.shutdown()


def test_a_failed_read_before_an_abort_still_aborts():
    """Reading the step in flight before an abort fails: the batch fails, and the abort is still applied (its
    ``done`` runs, so the orchestrator frees the pages)."""
    worker = worker_on("cpu", max_batch=2)
    read, armed = worker._read_in_flight, threading.Event()

    def failing_read():
        if armed.is_set():
            armed.clear()
            raise RuntimeError("injected read failure")
        read()

    try:
        worker._read_in_flight = failing_read
        admit(worker, "a", 5, [1, 2, 3, 4, 5, 6, 7], max_tokens=100)
        steps = attach_queue(worker)
        steps.get(timeout=10)  # stepping
        armed.set()
        done = threading.Event()
        worker.abort("a", done.set)
        assert done.wait(10) and not armed.is_set()
        while (message := steps.get(timeout=10))[2] != ["error"]:
            assert message[2] == [""]
    finally:
        worker.shutdown()


def test_a_failed_read_leaves_the_next_step_unsent(monkeypatch):
    """Reading a step fails with the next one launched: that next step is not read (its tokens would follow one
    never sent); the batch fails, each sequence's stream being its tokens made alone up to the failure."""
    reads = []

    class FailingThirdRead(TokenReadback):
        def tolist(self) -> list[int]:
            reads.append(self)
            if len(reads) == 3:
                raise RuntimeError("injected read failure")
            return super().tolist()

    monkeypatch.setattr(decode_worker, "TokenReadback", FailingThirdRead)
    worker = worker_on("cpu", max_batch=2)
    try:
        reference = alone(worker, 5, 1, 8)
        worker.eos_ids = []
        admit(worker, "a", 5, 1, max_tokens=8)
        tokens, reasons, _ = collect(attach_queue(worker), ["a"])
        assert reasons["a"] == "error" and tokens["a"] == reference[:2] + [-1]
    finally:
        worker.shutdown()


def test_a_new_stream_drops_the_old_streams_sequences():
    """An orchestrator replaced (a new stream attached): the old stream ends and its sequences stop (the new
    orchestrator counts their pages free); nothing more is sent for them on either stream."""
    worker = worker_on("cpu", max_batch=2)
    try:
        worker.eos_ids = []
        admit(worker, "a", 5, [1, 2, 3, 4, 5, 6, 7], max_tokens=100)
        ended = threading.Event()
        old: queue.Queue = queue.Queue()
        worker.attach(old.put, ended.set)
        old.get(timeout=10)  # stepping
        new = attach_queue(worker)
        assert ended.wait(10)
        time.sleep(0.2)
        assert not worker.running and new.empty()
        while not old.empty():  # what was sent before the new stream came
            assert old.get_nowait().seq_ids == ("a",)
    finally:
        worker.shutdown()


def test_token_ids_of_another_length_are_refused():
    worker = worker_on("cpu", max_batch=2)
    try:
        seq = DecodeSeq(5, 0, 0, np.array([1], dtype=np.int32))
        with pytest.raises(ValueError, match=r"token_ids \(2,\) for 1 sequences"):
            worker.runner.decode([seq], torch.tensor([5, 6]))
    finally:
        worker.shutdown()


def test_an_admission_that_fails_fails_that_sequence_and_the_loop_goes_on(monkeypatch):
    """An admission the worker cannot take (its penalty tables could not grow) ends that sequence with an "error"
    row; the loop lives on and the next sequence is served (the loop's death would end the stream as at a stop)."""
    worker = worker_on("cpu", max_batch=2)
    try:
        worker.eos_ids = []
        steps = attach_queue(worker)
        real_add = worker.penalties.add

        def failing_add(seq_id, *args):
            if seq_id == "bad":
                raise RuntimeError("out of memory")
            return real_add(seq_id, *args)

        monkeypatch.setattr(worker.penalties, "add", failing_add)
        admit(worker, "bad", 5, 1, max_tokens=4)
        admit(worker, "good", 5, 2, max_tokens=4)
        tokens, reasons, _ = collect(steps, ["bad", "good"])
        assert reasons == {"bad": "error", "good": "length"} and len(tokens["good"]) == 4
        assert worker.thread.is_alive() and not worker.running
    finally:
        worker.shutdown()


def test_each_steps_message_says_when_it_was_launched_and_read():
    """``DecodeStep.launched_s`` / ``read_s`` (``time.monotonic()``): within the run, a step read after its launch,
    the steps launched in order (request timelines place each token's hops with them)."""
    worker = worker_on("cpu", max_batch=2)
    try:
        worker.eos_ids = []
        messages: queue.Queue = queue.Queue()
        worker.attach(messages.put, lambda: None)
        before = time.monotonic()
        admit(worker, "a", 5, 1, max_tokens=4)
        steps = [messages.get(timeout=60) for _ in range(4)]
        after = time.monotonic()
        assert [step.token_ids for step in steps] and steps[-1].finish_reasons == ("length",)
        assert all(before <= step.launched_s <= step.read_s <= after for step in steps)
        assert [s.launched_s for s in steps] == sorted(s.launched_s for s in steps)
    finally:
        worker.shutdown()

