"""The decode stage with structured outputs (backends/runtime/sampling/grammar.py), steps overlapped (with a grammar
in the batch, the step before is read between a step's forward and its sampling): a sequence held to a grammar
streams exactly the greedy tokens of stepping it alone with each step's logits masked by a matcher of its own, ends
with the eos token that ends its match ("stop", even with ignore_eos), and a plain sequence beside it is unchanged;
a first token its grammar refuses fails the sequence. CPU, tiny model."""
from __future__ import annotations

import re

import numpy as np

from backends.ipc.protocol import DecodeAdmit, SamplingParams, StructuredOutput
from backends.runtime.model_runner import DecodeSeq
from backends.stages.decode_worker import DecodeWorker
# run_dir: that module's autouse fixture (each worker's own run directory), used here too
from tests.unit.backends.stages.test_decode_worker_steps import (  # noqa: F401
    alone, attach_queue, collect, run_dir, worker_on)

A = 64  # the tiny tokenizer's "a" (its ids are characters)


def held(worker: DecodeWorker, spec: StructuredOutput, first: int, page: int, steps: int) -> list[int]:
    """Greedy tokens of one sequence stepped alone, each step's logits masked by its own matcher, until the match
    ends (an eos token) or ``steps``."""
    matcher = worker.compiles.grammars.matcher(spec)
    assert matcher.accept_token(first)
    tokens, token = [], first
    for n in range(steps):
        logits = worker.runner.decode([DecodeSeq(token, n, n, np.array([page], dtype=np.int32))]).float().clone()
        token = int(worker.compiles.grammars.mask(logits, [matcher]).argmax(dim=-1)[0])
        tokens.append(token)
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            break
    return tokens


def test_a_grammar_holds_its_sequence_and_leaves_the_others_alone():
    worker = worker_on("cpu", max_batch=2)
    try:
        spec = StructuredOutput("regex", "a[b-d]{4}(xy|yx)")
        reference, plain = held(worker, spec, A, 1, 20), alone(worker, first=9, page=2, steps=12)
        assert reference[-1] in worker.eos_ids and len(reference) == 7  # four letters, two, then eos
        assert reference != alone(worker, first=A, page=1, steps=7)  # the grammar changes the greedy tokens
        steps = attach_queue(worker)
        params = SamplingParams(temperature=0, ignore_eos=True, structured=spec)
        worker.admit(DecodeAdmit("held", (1,), 0, A, 0, 1, 30, params))
        worker.admit(DecodeAdmit("plain", (2,), 0, 9, 0, 1, 13, SamplingParams(temperature=0)))
        tokens, reasons, after_end = collect(steps, ["held", "plain"])
        assert (tokens["held"], reasons["held"]) == (reference, "stop")
        assert tokens["plain"][:len(plain)] == plain[:len(tokens["plain"])] and not after_end
        assert not worker.running
    finally:
        worker.shutdown()


def test_a_sequence_waits_for_its_grammar_off_the_loop_and_an_abort_meanwhile_drops_it(monkeypatch):
    """The compile is slow (held by an event): the plain sequence beside it streams meanwhile; a held sequence
    aborted before its grammar is ready never runs, and one that waited joins once it is."""
    import threading

    worker = worker_on("cpu", max_batch=3)
    release, compile_ = threading.Event(), worker.compiles.grammars.matcher
    monkeypatch.setattr(worker.compiles.grammars, "matcher", lambda spec: (release.wait(30), compile_(spec))[1])
    try:
        steps = attach_queue(worker)
        spec = StructuredOutput("regex", "a[b-d]{4}(xy|yx)")
        params = SamplingParams(temperature=0, structured=spec)
        worker.admit(DecodeAdmit("held", (1,), 0, A, 0, 1, 30, params))
        worker.admit(DecodeAdmit("gone", (3,), 0, A, 0, 1, 30, params))
        worker.admit(DecodeAdmit("plain", (2,), 0, 9, 0, 1, 5, SamplingParams(temperature=0)))
        aborted = threading.Event()
        worker.abort("gone", aborted.set)
        tokens, reasons, _ = collect(steps, ["plain"])
        assert reasons["plain"] == "length" and aborted.wait(10)  # while the grammars compile
        release.set()
        tokens, reasons, _ = collect(steps, ["held"])
        assert (tokens["held"], reasons["held"]) == (held(worker, spec, A, 1, 20), "stop")
        assert not worker.running and steps.empty()  # nothing of "gone"
    finally:
        release.set()
        worker.shutdown()


def test_a_first_token_its_grammar_refuses_fails_the_sequence_alone():
    worker = worker_on("cpu", max_batch=2)
    try:
        steps = attach_queue(worker)
        params = SamplingParams(temperature=0, structured=StructuredOutput("regex", "b+"))
        worker.admit(DecodeAdmit("refused", (1,), 0, A, 0, 1, 10, params))  # "a" cannot start "b+"
        worker.admit(DecodeAdmit("plain", (2,), 0, 9, 0, 1, 5, SamplingParams(temperature=0)))
        tokens, reasons, _ = collect(steps, ["refused", "plain"])
        assert (tokens["refused"], reasons["refused"]) == ([-1], "error")
        assert reasons["plain"] == "length" and len(tokens["plain"]) == 4
    finally:
        worker.shutdown()


def test_with_a_grammar_in_the_batch_a_step_is_read_while_the_next_ones_forward_runs():
    """The order of the loop's work: step k+1's forward is launched before step k is read (the GPU keeps the
    forward while the host feeds the matchers), and step k+1's sampling after that read (its mask follows step k)."""
    worker = worker_on("cpu", max_batch=2)
    events: list[str] = []
    forward, read, mask = worker.runner.decode, worker._read, worker.compiles.grammars.mask
    worker.runner.decode = lambda *a, **k: (events.append("forward"), forward(*a, **k))[1]
    worker._read = lambda *a, **k: (events.append("read"), read(*a, **k))[1]
    worker.compiles.grammars.mask = lambda *a, **k: (events.append("mask"), mask(*a, **k))[1]
    try:
        steps = attach_queue(worker)
        params = SamplingParams(temperature=0, structured=StructuredOutput("regex", "a[b-d]{8}"))
        worker.admit(DecodeAdmit("held", (1,), 0, A, 0, 1, 16, params))
        worker.admit(DecodeAdmit("plain", (2,), 0, 9, 0, 1, 16, SamplingParams(temperature=0)))
        _, reasons, _ = collect(steps, ["held", "plain"])
        assert reasons == {"held": "stop", "plain": "length"}
        shown = "".join(e[0] for e in events)  # f(orward), r(ead), m(ask)
        assert "frm" in shown and not re.search("mr+f", shown), shown  # no read between a mask and the next forward
    finally:
        worker.shutdown()


def test_a_read_that_fails_midway_still_sends_the_rows_it_made(monkeypatch):
    """A sequence that ended earlier in the same read (its row made, itself gone from the batch) gets its last
    message with the failure (_fail_batch), not none at all: the orchestrator frees its pages on it."""
    from backends.stages import decode_worker

    real, state = decode_worker.finish_reason, {"ended": False, "raised": False}

    def failing(*args, **kwargs):
        if state["ended"] and not state["raised"]:
            state["raised"] = True
            raise RuntimeError("injected")
        reason = real(*args, **kwargs)
        state["ended"] = state["ended"] or reason == "length"
        return reason

    monkeypatch.setattr(decode_worker, "finish_reason", failing)
    worker = worker_on("cpu", max_batch=2)
    try:
        steps = attach_queue(worker)
        worker.admit(DecodeAdmit("short", (1,), 0, 5, 0, 1, 3, SamplingParams(temperature=0)))
        worker.admit(DecodeAdmit("long", (2,), 0, 9, 0, 1, 10, SamplingParams(temperature=0)))
        tokens, reasons, _ = collect(steps, ["short", "long"])
        assert reasons == {"short": "length", "long": "error"} and len(tokens["short"]) == 2
    finally:
        worker.shutdown()
