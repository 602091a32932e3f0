"""Sampler: greedy, top-k/top-p, seeded determinism, min_tokens, per-request parameters in one batch."""
from __future__ import annotations

import pytest
import torch

from backends.runtime.sampler import SamplingParams, sample

VOCAB = 50
EOS = [3, 7]


def _logits(batch: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax():
    logits = _logits()
    tokens = sample(logits, [SamplingParams(temperature=0)] * 4, [0] * 4, EOS)
    assert tokens == logits.argmax(-1).tolist()


def test_top_k_one_equals_greedy():
    logits = _logits()
    tokens = sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 4, [0] * 4, EOS)
    assert tokens == logits.argmax(-1).tolist()


def test_tiny_top_p_equals_greedy():
    logits = _logits()
    tokens = sample(logits, [SamplingParams(temperature=1.0, top_p=1e-6)] * 4, [0] * 4, EOS)
    assert tokens == logits.argmax(-1).tolist()


def test_top_k_restricts_to_top_tokens():
    logits = _logits(batch=1)
    top3 = set(logits[0].topk(3).indices.tolist())
    drawn = {sample(logits, [SamplingParams(top_k=3, seed=s)], [0], EOS)[0] for s in range(200)}
    assert drawn <= top3 and len(drawn) > 1


def test_seeded_draw_is_a_function_of_seed_and_step():
    logits = _logits(batch=1)
    flat = torch.zeros(1, VOCAB)  # uniform: the draw depends on the generator only
    params = [SamplingParams(temperature=1.0, seed=1234)]
    stream = [sample(flat, params, [n], EOS)[0] for n in range(30)]
    torch.manual_seed(99)  # the global RNG does not matter
    again = [sample(flat, params, [n], EOS)[0] for n in range(30)]
    assert stream == again
    assert len(set(stream)) > 5  # different steps give different draws
    other = [sample(flat, [SamplingParams(temperature=1.0, seed=1235)], [n], EOS)[0] for n in range(30)]
    assert other != stream
    # Step 7 drawn alone (e.g. in another process) equals step 7 of the stream.
    assert sample(flat, params, [7], EOS)[0] == stream[7]
    assert sample(logits, params, [3], EOS) == sample(logits.clone(), params, [3], EOS)


def test_min_tokens_masks_eos():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS[0]] = 100.0
    logits[0, EOS[1]] = 90.0
    params = [SamplingParams(temperature=0, min_tokens=2)]
    assert sample(logits, params, [0], EOS)[0] not in EOS
    assert sample(logits, params, [1], EOS)[0] not in EOS
    assert sample(logits, params, [2], EOS)[0] == EOS[0]
    sampled = sample(logits, [SamplingParams(temperature=1.0, min_tokens=1, seed=0)], [0], EOS)[0]
    assert sampled not in EOS


def test_per_request_parameters_in_one_batch():
    logits = _logits(batch=3)
    logits[1, EOS[0]] = 1000.0
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, min_tokens=5),
              SamplingParams(temperature=0.7, top_p=0.9, seed=5)]
    tokens = sample(logits, params, [0, 0, 4], EOS)
    assert tokens[0] == int(logits[0].argmax())
    without_eos = logits[1].clone()
    without_eos[EOS] = float("-inf")
    assert tokens[1] == int(without_eos.argmax())
    assert tokens[2] == sample(logits[2:], params[2:], [4], EOS)[0]


def test_invalid_parameters_raise():
    for kwargs in ({"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -1}, {"min_tokens": -2},
                   {"temperature": float("nan")}):
        with pytest.raises(ValueError):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError):
        sample(_logits(batch=2), [SamplingParams()], [0], EOS)
