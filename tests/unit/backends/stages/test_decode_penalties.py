"""The decode stage with penalties, steps overlapped (step N+1 launched before step N's tokens reach the host):
each sequence streams exactly the greedy tokens of stepping it alone with its logits penalized by the reference
(transformers' repetition processor, vLLM's presence/frequency formula: tests/unit/backends/runtime/sampling/
test_penalties.py), its counts updated on the device in step order; sequences without penalties beside them are
unchanged, and sequences admitted later into freed slots carry nothing of their last owners; a ``logit_bias`` is added
before the penalties. CPU, tiny model."""
from __future__ import annotations

import numpy as np

from backends.ipc.protocol import DecodeAdmit, SamplingParams
from backends.runtime.model_runner import DecodeSeq
from backends.stages.decode_worker import DecodeWorker
from tests.unit.backends.runtime.sampling.test_penalties import reference
# run_dir: that module's autouse fixture (each worker's own run directory), used here too
from tests.unit.backends.stages.test_decode_worker_steps import (  # noqa: F401
    attach_queue, collect, expected, run_dir, worker_on)

GREEDY = SamplingParams(temperature=0.0)


def alone(worker: DecodeWorker, first: int, page: int, steps: int, params: SamplingParams,
          prompt: list[int]) -> list[int]:
    """Greedy tokens of one sequence stepped alone from an empty cache, ``first`` being its first output token,
    each step's logits biased (``logit_bias``) and then penalized by the reference before the argmax (vLLM v1's
    order)."""
    tokens, token, output = [], first, [first]
    for n in range(steps):
        logits = worker.runner.decode([DecodeSeq(token, n, n, np.array([page], dtype=np.int32))])[0].float().clone()
        for biased, bias in params.logit_bias:
            logits[biased] += bias
        token = int(reference(logits, prompt, output, params).argmax())
        tokens.append(token)
        output.append(token)
    return tokens


def first_token_that_counts(worker: DecodeWorker, params: SamplingParams) -> int:
    """A first output token whose count (made at admission) changes the next greedy token under ``params``."""
    for token in range(worker.runner.model.lm_head.out_features):
        logits = worker.runner.decode([DecodeSeq(token, 0, 0, np.array([1], dtype=np.int32))])[0]
        if int(reference(logits, [], [token], params).argmax()) != int(logits.argmax()):
            return token
    raise AssertionError("no first token's count changes the next token")


def admit(worker: DecodeWorker, seq_id: str, first: int, page: int, max_tokens: int, params: SamplingParams,
          prompt: list[int]) -> None:
    """As the engine admits: after the first output token (``num_generated`` 1), the prompt's distinct ids sent
    only for a repetition penalty."""
    worker.admit(DecodeAdmit(seq_id, (page,), 0, first, 0, 1, max_tokens, params,
                             tuple(sorted(set(prompt))) if params.repetition_penalty != 1 else ()))


def test_penalized_steps_equal_one_by_one_references():
    """Three waves: a penalized sequence ending by eos with its next step in flight, one without penalties, one
    waiting for a row; then copies of the first wave's penalized ones, which take their freed slots (the last
    freed first); then six more, which fit in the slots freed by then (the tables do not grow)."""
    worker = worker_on("cpu", max_batch=2)
    try:
        plain = alone(worker, 5, 1, 15, GREEDY, [])
        often = max(set(plain), key=plain.count)  # as a first token, its count at admission matters
        # tokens greedy decoding would make, so that the repetition penalty bites, but for the first token, which
        # is then penalized for being in the output only
        prompt = [t for t in plain[:6] if t != often] + [1, 2]
        params = {"a": SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=0.5),
                  "b": GREEDY,
                  "c": SamplingParams(temperature=0, repetition_penalty=0.8, frequency_penalty=1.0)}
        params.update({"c2": params["c"], "a2": params["a"]})
        params.update({f"w{i}": SamplingParams(temperature=0, repetition_penalty=[1.0, 2.0, 1.2][i % 3],
                                               presence_penalty=[2.0, -0.5, 0][i % 3], frequency_penalty=i / 4)
                       for i in range(6)})
        firsts = {s: (9 if s == "b" else often) for s in params}
        firsts["w0"] = first_token_that_counts(worker, params["w0"])
        pages = {"a": 1, "b": 2, "c": 3, "c2": 1, "a2": 2, **{f"w{i}": i + 1 for i in range(6)}}
        limits = {"a": 14, "b": 7, "c": 11, "c2": 11, "a2": 14, **{f"w{i}": 6 + i for i in range(6)}}
        references = {s: alone(worker, firsts[s], pages[s], 15, params[s], prompt) for s in params}
        assert references["c"] != alone(worker, often, 3, 15, GREEDY, [])  # the penalties change the greedy tokens
        eos = references["a"][3]
        worker.eos_ids = [eos]
        steps = attach_queue(worker)
        for wave in (["a", "b", "c"], ["c2", "a2"], [f"w{i}" for i in range(6)]):
            for s in wave:
                admit(worker, s, firsts[s], pages[s], limits[s], params[s], prompt)
            tokens, reasons, after_end = collect(steps, wave)
            for s in wave:  # with num_generated 1 at admission, decode makes max_tokens - 1 tokens
                assert (tokens[s], reasons[s]) == expected(references[s], limits[s] - 1, [eos]), s
            assert not after_end and not worker.running
        assert worker.penalties.counts.shape[0] == 8
    finally:
        worker.shutdown()


def test_a_logit_bias_is_added_before_the_penalties_beside_a_sequence_without_one():
    """A bias that lifts the third most likely token above the first, and one that bans the plain reply's second
    token, under repetition and presence penalties (whose multiply depends on the bias's sign): the stage's tokens
    are the one-by-one reference's, the plain sequence beside it is unchanged, the banned token never comes."""
    worker = worker_on("cpu", max_batch=2)
    try:
        plain = alone(worker, 5, 1, 12, GREEDY, [])
        prompt = plain[:4] + [1, 2]
        logits = worker.runner.decode([DecodeSeq(5, 0, 0, np.array([1], dtype=np.int32))])[0].float()
        third = int(logits.topk(3).indices[2])
        params = SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=0.5,
                                logit_bias=((third, float(logits.max() - logits[third]) + 0.3), (plain[1], -100.0)))
        biased, unbiased = alone(worker, 5, 1, 12, params, prompt), alone(worker, 9, 2, 12, GREEDY, [])
        assert biased != alone(worker, 5, 1, 12, SamplingParams(temperature=0, repetition_penalty=1.5,
                                                                presence_penalty=0.5), prompt)
        steps = attach_queue(worker)
        admit(worker, "a", 5, 1, 13, params, prompt)
        admit(worker, "b", 9, 2, 13, GREEDY, [])
        tokens, _, _ = collect(steps, ["a", "b"])
        assert (tokens["a"], tokens["b"]) == (biased, unbiased) and plain[1] not in tokens["a"]
    finally:
        worker.shutdown()
