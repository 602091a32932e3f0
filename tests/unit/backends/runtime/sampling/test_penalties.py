"""Penalties (backends/runtime/sampling/penalties.py) against references: transformers'
``RepetitionPenaltyLogitsProcessor`` for the repetition penalty, and vLLM's documented presence/frequency formula
(``logits -= presence * (count > 0) + frequency * count`` over the output's tokens, written out in
tests/reference.py); the decode stage's per-sequence counts through slots that are freed, reused and grown."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from backends.ipc.protocol import SamplingParams
from backends.runtime.sampling.penalties import PenaltyState, apply_penalties, penalize_first_tokens
from tests.reference import PresenceFrequencyPenalty

VOCAB = 64


def reference(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """One row as vLLM penalizes it: transformers' repetition processor over prompt + output, then the
    frequency and presence penalties over the output's counts (vLLM's order: frequency, then presence)."""
    row, ids = logits.float().clone()[None], torch.tensor([prompt + output], dtype=torch.long, device=logits.device)
    if prompt or output:
        row = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, row)
    return PresenceFrequencyPenalty(len(prompt), p.presence_penalty, p.frequency_penalty)(ids, row)[0]


def _logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_first_tokens_equal_transformers_repetition_processor():
    """Positive logits divided, negative multiplied, for the tokens of each row's own prompt only; rows without a
    repetition penalty (or with presence/frequency only: no output yet) are left as they are."""
    logits = _logits(4, 0)
    prompts = [(1, 5, 5, 9, 40), (2, 3), (7, 7, 7), (1, 2, 3)]
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(),
              SamplingParams(repetition_penalty=0.7, presence_penalty=1.0), SamplingParams(frequency_penalty=2.0)]
    out = penalize_first_tokens(logits, prompts, params)
    for i in range(4):
        assert torch.equal(out[i], reference(logits[i], list(prompts[i]), [], params[i])), i
    assert not torch.equal(out[0], logits[0]) and torch.equal(out[1], logits[1]) and torch.equal(out[3], logits[3])


def test_first_tokens_without_a_repetition_penalty_are_the_logits_themselves():
    logits = _logits(2, 1)
    assert penalize_first_tokens(logits, [(1,), (2,)], [SamplingParams(presence_penalty=1), SamplingParams()]) is logits
    with pytest.raises(ValueError, match="2 logit rows, 1 prompts"):
        penalize_first_tokens(logits, [(1,)], [SamplingParams()] * 2)


def test_apply_penalties_leaves_its_input_and_other_rows_alone():
    logits = _logits(3, 2).to(torch.bfloat16)
    before = logits.clone()
    counts = torch.zeros(1, VOCAB, dtype=torch.int32)
    counts[0, 4] = 3
    out = apply_penalties(logits, torch.tensor([1]), torch.zeros(1, VOCAB, dtype=torch.bool), counts,
                          torch.tensor([[1.0, 0.5, 0.25]]))
    assert out.dtype == torch.float32 and torch.equal(logits, before)
    assert torch.equal(out[[0, 2]], logits[[0, 2]].float())
    assert out[1, 4] == logits[1, 4].float() - 0.25 * 3 - 0.5  # frequency * count, then presence


@pytest.mark.parametrize("params", [
    SamplingParams(repetition_penalty=1.5),
    SamplingParams(presence_penalty=0.75, frequency_penalty=-0.5),
    SamplingParams(repetition_penalty=0.8, presence_penalty=-1.25, frequency_penalty=1.5),
])
def test_decode_counts_follow_the_sampled_tokens(params):
    """A sequence stepped with its penalties applied and its sampled tokens counted on the device gets, at every
    step, the reference's logits for its prompt and output so far (the first output token counted at admission)."""
    state = PenaltyState(VOCAB, torch.device("cpu"))
    prompt, output = [3, 3, 8, 20], [11]
    state.add("a", params, tuple(sorted(set(prompt))), tuple(output))
    for step in range(12):
        logits = _logits(1, 10 + step)
        penalized, rows = state.penalize(logits, ["a"])
        torch.testing.assert_close(penalized[0], reference(logits[0], prompt, output, params), rtol=0, atol=1e-6)
        token = torch.tensor([[11, 3, 30][step % 3]])  # repeats, a prompt token, a new one
        state.count(rows, token)
        output.append(int(token))


def test_rows_without_penalties_are_untouched_and_cost_no_slot():
    state = PenaltyState(VOCAB, torch.device("cpu"))
    state.add("plain", SamplingParams(temperature=0.5, stop_token_ids=(3,)), (1, 2), (4,))
    logits = _logits(2, 3)
    assert state.penalize(logits, ["plain", "other"]) == (logits, None) and not state.slots
    state.add("p", SamplingParams(presence_penalty=1.0), (), (4,))
    penalized, rows = state.penalize(logits, ["plain", "p"])
    assert torch.equal(penalized[0], logits[0]) and rows.rows.tolist() == [1]


def test_slots_are_freed_reinitialised_and_grown():
    """Many sequences coming and going in a batch of changing company: every row equals its own reference, so a
    reused slot carries nothing of its last owner and growing the tables keeps what they held."""
    rng = random.Random(0)
    state = PenaltyState(VOCAB, torch.device("cpu"))
    live: dict[str, tuple[list[int], list[int], SamplingParams]] = {}
    made = 0
    for step in range(60):
        if rng.random() < 0.5 or not live:  # admit one or several
            for _ in range(rng.randrange(1, 6)):
                seq_id = f"s{made}"
                made += 1
                prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 10))]
                params = SamplingParams(repetition_penalty=rng.choice([1.0, 1.25, 0.5]),
                                        presence_penalty=rng.choice([0.0, 0.5, -1.0]),
                                        frequency_penalty=rng.choice([0.0, 0.25, 2.0]))
                live[seq_id] = (prompt, [rng.randrange(VOCAB)], params)
                state.retain(live)
                state.add(seq_id, params, tuple(sorted(set(prompt))), tuple(live[seq_id][1]))
        batch = rng.sample(sorted(live), min(len(live), 6))
        logits = _logits(len(batch), 100 + step)
        penalized, rows = state.penalize(logits, batch)
        for i, seq_id in enumerate(batch):
            prompt, output, params = live[seq_id]
            expected = reference(logits[i], prompt, output, params) if params.penalized else logits[i]
            torch.testing.assert_close(penalized[i], expected, rtol=0, atol=1e-5, msg=f"step {step}, {seq_id}")
        tokens = torch.tensor([rng.randrange(VOCAB) for _ in batch])
        state.count(rows, tokens)
        for seq_id, token in zip(batch, tokens.tolist()):
            live[seq_id][1].append(token)
        for seq_id in rng.sample(sorted(live), rng.randrange(0, 3)):  # some end
            del live[seq_id]
    assert made > 16 and state.counts.shape[0] >= 16  # the tables grew past their first 8 slots


def test_sampling_params_refuse_vllms_out_of_range_penalties():
    for bad in (dict(repetition_penalty=0.0), dict(repetition_penalty=float("inf")), dict(presence_penalty=2.5),
                dict(frequency_penalty=-2.5), dict(stop_token_ids=(-1,)), dict(stop_token_ids=(4, 4))):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    assert not SamplingParams(stop_token_ids=(1,)).penalized and SamplingParams(frequency_penalty=0.1).penalized
