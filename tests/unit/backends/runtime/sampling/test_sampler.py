"""Sampler: greedy, top-k/top-p, seeded determinism, min_tokens, per-request parameters in one batch, batch
independence, the drawn distribution, and the exact integer hash behind the draws."""
from __future__ import annotations

import math

import pytest
import torch

from backends.runtime.sampling import sampler
from backends.runtime.sampling.sampler import (SamplingParams, _exponentials, _lowbias32, _row_key, _token_hash, _top_p_mask,
                                      sample)

VOCAB = 50
EOS = [3, 7]
M32 = (1 << 32) - 1
# Chi-square critical values at p = 0.001 by degrees of freedom (scipy.stats.chi2.ppf(0.999, df)). The seeds
# are fixed, so each test is deterministic; a correct sampler passes these with probability 0.999 per case.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}


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
    drawn = set(sample(logits.expand(200, -1), [SamplingParams(top_k=3, seed=s) for s in range(200)],
                       [0] * 200, EOS))
    assert drawn == top3


def test_seeded_draw_is_a_function_of_seed_and_step():
    logits = _logits(batch=1)
    flat = torch.zeros(1, VOCAB)  # uniform: the draw depends on the random numbers only
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
    # The whole stream in one call (the steps as rows) is the same stream.
    assert sample(flat.expand(30, -1), params * 30, list(range(30)), EOS) == stream


def test_unseeded_draws_are_fresh():
    flat = torch.zeros(64, VOCAB)
    params = [SamplingParams(temperature=1.0)] * 64
    torch.manual_seed(0)
    first = sample(flat, params, [0] * 64, EOS)
    torch.manual_seed(0)  # unseeded rows do not use torch's global RNG (the loader seeds it)
    assert sample(flat, params, [0] * 64, EOS) != first


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
    before = logits.clone()
    sample(logits, params, [0], EOS)
    assert torch.equal(logits, before)  # the caller's logits are not changed


def test_min_tokens_masks_each_rows_own_stop_token_ids():
    """vLLM's min_tokens masks eos and the row's stop_token_ids; another row's stop ids stay."""
    logits = torch.zeros(3, VOCAB)
    logits[:, 11], logits[:, 12], logits[:, EOS[0]], logits[:, 20] = 100.0, 90.0, 80.0, 50.0
    params = [SamplingParams(temperature=0, min_tokens=1, stop_token_ids=(11, 12)),
              SamplingParams(temperature=0, min_tokens=1, stop_token_ids=(12,)),
              SamplingParams(temperature=0, stop_token_ids=(11,))]
    assert sample(logits, params, [0, 0, 0], EOS) == [20, 11, 11]
    assert sample(logits, params, [1, 1, 1], EOS) == [11, 11, 11]  # min_tokens reached


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


def test_seeded_row_does_not_depend_on_its_batch():
    rows = 40
    logits = (_logits(batch=rows, seed=3) * 2).mul(2).round().div(2)  # on a 0.5 grid: ties at top-k/top-p edges
    targets = [SamplingParams(temperature=0.5 + i % 3 * 0.4, top_k=[0, 5, 30][i % 3], top_p=[1.0, 0.9, 0.6][i % 3],
                              seed=1000 + i, min_tokens=i % 2) for i in range(rows)]
    steps = [i % 7 for i in range(rows)]
    alone = [sample(logits[i:i + 1], [targets[i]], [steps[i]], EOS)[0] for i in range(rows)]
    fillers = [SamplingParams(temperature=0), SamplingParams(temperature=1.0),  # greedy, unseeded
               SamplingParams(temperature=1.3, top_k=2, seed=5), SamplingParams(temperature=0.9, top_p=0.3, seed=6),
               SamplingParams(temperature=0, min_tokens=9)]
    batch_logits, batch_params, batch_steps, where = [], [], [], []
    for i in range(rows):  # each target between fillers, in a different place and company every time
        for j in range(i % 4):
            batch_logits.append(_logits(batch=1, seed=100 + i * 4 + j)[0])
            batch_params.append(fillers[(i + j) % len(fillers)])
            batch_steps.append(j)
        where.append(len(batch_logits))
        batch_logits.append(logits[i])
        batch_params.append(targets[i])
        batch_steps.append(steps[i])
    tokens = sample(torch.stack(batch_logits), batch_params, batch_steps, EOS)
    assert [tokens[w] for w in where] == alone
    assert len(set(alone)) > 5


def _chi_square(tokens: list[int], target: list[float]) -> float:
    counts = [tokens.count(t) for t in range(len(target))]
    for t, p in enumerate(target):
        if p == 0:
            assert counts[t] == 0, f"token {t} has probability 0 but was drawn {counts[t]} times"
    n = len(tokens)
    return sum((counts[t] - n * p) ** 2 / (n * p) for t, p in enumerate(target) if p > 0)


PROBS = [0.4, 0.3, 0.15, 0.1, 0.05]


@pytest.mark.parametrize("kwargs, target", [
    ({}, PROBS),
    ({"temperature": 2.0}, [math.sqrt(p) / sum(math.sqrt(q) for q in PROBS) for p in PROBS]),
    ({"top_k": 2}, [0.4 / 0.7, 0.3 / 0.7, 0, 0, 0]),
    # Exclusive cumulative sums 0, .4, .7, .85, .95: tokens from the 4th reach 0.8 already.
    ({"top_p": 0.8}, [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0]),
    # Top-k first: the 3 kept renormalise to .47, .35, .18, so the third is past 0.75 (it would not be by .7).
    ({"top_k": 3, "top_p": 0.75}, [0.4 / 0.7, 0.3 / 0.7, 0, 0, 0]),
    # Min-p keeps probabilities of at least 0.3 x 0.4 = 0.12.
    ({"min_p": 0.3}, [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0]),
    # At temperature 2 the ratios to the largest are sqrt(p / 0.4): 1, .87, .61, .5, .35.
    ({"min_p": 0.55, "temperature": 2.0}, [math.sqrt(p) / sum(math.sqrt(q) for q in PROBS[:3]) if p > 0.12 else 0
                                           for p in PROBS]),
    # Min-p first (vLLM's order): its 3 renormalise to .47, .35, .18, so the third is past 0.8; top-p first would
    # keep all three.
    ({"min_p": 0.3, "top_p": 0.8}, [0.4 / 0.7, 0.3 / 0.7, 0, 0, 0]),
])
def test_draws_follow_the_distribution(kwargs, target):
    n = 4000
    logits = torch.tensor(PROBS).log()[None, :].expand(n, -1)
    # Many requests, one step each, in one batched call.
    tokens = sample(logits, [SamplingParams(seed=7 * s + 1, **kwargs) for s in range(n)], [0] * n, [])
    dof = sum(p > 0 for p in target) - 1
    assert _chi_square(tokens, target) < CHI2_999[dof]
    # One request over many steps (the decode worker's stream).
    tokens = sample(logits, [SamplingParams(seed=42, **kwargs)] * n, list(range(n)), [])
    assert _chi_square(tokens, target) < CHI2_999[dof]


def _reference_kept(row: torch.Tensor, temperature: float, top_p: float, top_k: int,
                    min_p: float = 0.0) -> tuple[torch.Tensor, bool]:
    """The per-row rule of ``SamplingParams``, written plainly in float64: temperature; min-p keeps the tokens whose
    probability is at least min_p times the largest; top-k keeps the scores that reach the k-th highest; softmax;
    top-p keeps a token when the tokens strictly more likely than it hold less than top_p. Returns bool ``[V]`` and
    whether the row is clear of float rounding (no token's ratio to the largest probability within 1e-4 of min_p,
    no token's nonzero mass above it within 1e-5 of top_p)."""
    row = row.double() / temperature
    clear = True
    if min_p > 0:
        ratio = torch.softmax(row, dim=-1) / torch.softmax(row, dim=-1).max()
        clear = bool(((ratio - min_p).abs() > 1e-4 * min_p).all()) or min_p == 1
        row = row.masked_fill(ratio < min_p if min_p < 1 else row < row.max(), -math.inf)
    if 0 < top_k < row.numel():
        row = row.masked_fill(row < row.sort(descending=True).values[top_k - 1], -math.inf)
    probs = torch.softmax(row, dim=-1)
    kept = probs > 0
    if top_p < 1 - 2 ** -25:  # float32 rounds it to 1 from there: off
        above = torch.stack([probs[probs > q].sum() for q in probs])
        kept &= above < top_p
        return kept, clear and bool(((above - top_p).abs() > 1e-5).logical_or(above == 0).all())
    return kept, clear


def _drawn_from(monkeypatch, logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> torch.Tensor:
    """The scores ``sample_tensor`` races over for its drawn rows (-inf where filtered), float32 ``[drawn, V]``."""
    seen, eager = [], sampler._race

    def race(scores, keys, token_hash):
        seen.append(scores.clone())
        return eager(scores, keys, token_hash)

    monkeypatch.setattr(sampler, "_race", race)
    sampler.sample_tensor(logits, params, steps, [])
    monkeypatch.undo()
    return seen[0]


@pytest.mark.parametrize("tied", [False, True])
def test_random_batches_draw_from_the_rule_s_tokens(monkeypatch, tied):
    # Random mixes of every kind of row, in random company; tied: logits on a 0.5 grid (as bf16 logits tie).
    gen = torch.Generator().manual_seed(11)
    top_ks, top_ps = [0, 1, 2, 5, 20, VOCAB - 1, VOCAB, VOCAB + 5], [1.0, 1 - 1e-9, 0.95, 0.7, 0.5, 0.2, 1e-7]
    min_ps = [0.0, 0.0, 0.0, 0.01, 0.1, 0.5, 1.0]
    checked = 0
    for _ in range(60):
        rows = int(torch.randint(1, 9, (1,), generator=gen))
        logits = torch.randn(rows, VOCAB, generator=gen) * 3
        if tied:
            logits = logits.mul(2).round().div(2)
        params = [SamplingParams(temperature=float(torch.rand(1, generator=gen)) * 1.5 + 0.3,
                                 top_k=top_ks[int(torch.randint(len(top_ks), (1,), generator=gen))],
                                 top_p=top_ps[int(torch.randint(len(top_ps), (1,), generator=gen))],
                                 min_p=min_ps[int(torch.randint(len(min_ps), (1,), generator=gen))], seed=1)
                  for _ in range(rows)]
        scores = _drawn_from(monkeypatch, logits, params, [0] * rows)
        for i, p in enumerate(params):
            expected, clear = _reference_kept(logits[i], p.temperature, p.top_p, p.top_k, p.min_p)
            if clear:
                checked += 1
                assert torch.equal(scores[i] > -math.inf, expected), (i, p)
                torch.testing.assert_close(scores[i][expected], logits[i][expected] / p.temperature)
    assert checked > 230


def test_top_p_at_tiny_temperatures_normalises_exactly(monkeypatch):
    # logits / 1e-5 reach 3e6: float32's log-sum-exp of them is off by percents unless taken relative to the
    # top score. Token 2 holds 0.0243 of the probability; the two above it 0.9757 >= 0.96: top-p drops it.
    logits = torch.tensor([[30.0, 30.0, 30.0 - 3e-5] + [0.0] * (VOCAB - 3)])
    for top_k in (0, 3):  # the sort and top-k's candidates
        scores = _drawn_from(monkeypatch, logits, [SamplingParams(temperature=1e-5, top_p=0.96, top_k=top_k)], [0])
        assert (scores[0] > -math.inf).nonzero().flatten().tolist() == [0, 1], top_k


def test_top_k_ties_beyond_the_candidates_count_for_top_p(monkeypatch):
    # top_k=2 keeps the four tokens tied at the 2nd place too; with them, token 0 holds 0.405 < 0.5 of the
    # probability, so top-p keeps all five, whether or not another row takes the sort.
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 1.0, -5.0] + [-9.0] * (VOCAB - 6)])
    target = SamplingParams(temperature=1.0, top_k=2, top_p=0.5, seed=3)
    for company in ([], [SamplingParams(temperature=1.0, top_p=0.5)]):
        batch = logits.expand(1 + len(company), -1)
        scores = _drawn_from(monkeypatch, batch, [target, *company], [0] * batch.shape[0])
        assert (scores[0] > -math.inf).nonzero().flatten().tolist() == [0, 1, 2, 3, 4]


def test_top_p_keeps_ties():
    # Two tokens tie for second place: when the first does not reach top_p, both stay (not one of them by
    # the order a sort happens to give them).
    scores = _top_p_mask(torch.tensor([[2.0, 1.0, 1.0, 0.0, -1.0]]), torch.tensor([0.7]), torch.ones(1, 1))
    assert (scores > -math.inf).tolist() == [[True, True, True, False, False]]


def test_rows_that_would_overflow_or_have_no_finite_logit_do_not_fail():
    logits = _logits(batch=3)
    logits[1] = float("nan")
    only_eos = torch.full((1, VOCAB), -math.inf)
    only_eos[0, EOS] = 1.0
    # Tiny temperatures are greedy: logits / 1e-38 would overflow float32 (and 1e-46 is 0 in float32).
    for t in (1e-38, 1e-46, 1e-6):
        assert sample(logits[:1], [SamplingParams(temperature=t, top_p=0.9)], [0], EOS) == [int(logits[0].argmax())]
    tokens = sample(logits, [SamplingParams(temperature=1.0, top_p=0.9, top_k=k, seed=1) for k in (0, 5, 0)],
                    [0] * 3, EOS)
    assert len(tokens) == 3 and all(0 <= t < VOCAB for t in tokens)  # row 1 is NaN: any token, no error
    # eos masked by min_tokens leaves no finite logit: a token comes back, no out-of-range index
    assert len(sample(only_eos, [SamplingParams(temperature=1.0, top_p=0.9, min_tokens=1)], [0], EOS)) == 1


def _lowbias32_reference(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def test_hash_is_exact_integer_arithmetic():
    # splitmix64 seeded with 0: its first outputs are 0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4 (Vigna's
    # splitmix64.c); a row key is the top half of output number num_generated.
    assert _row_key(0, 0) == 0xE220A839 and _row_key(0, 1) == 0x6E789E6A
    values = [0, 1, 2, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, M32 - 1, M32]
    values += torch.randint(0, 1 << 32, (2000,), generator=torch.Generator().manual_seed(0)).tolist()
    hashed = _lowbias32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert hashed == [_lowbias32_reference(v) for v in values]
    keys = [0, 1, M32, 0x12345678]
    e = _exponentials(torch.tensor(keys), _token_hash(300, torch.device("cpu")))
    for row, key in enumerate(keys):
        for token in (0, 1, 299):
            h = _lowbias32_reference(_lowbias32_reference(token) ^ key)
            u = ((h >> 9) + 0.5) / 2 ** 23  # exact in float32 and float64
            assert torch.tensor(u, dtype=torch.float32).item() == u
            assert e[row, token].item() == torch.tensor(u).log().neg().item()


def test_invalid_parameters_raise():
    for kwargs in ({"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -1}, {"min_tokens": -2},
                   {"temperature": float("nan")}, {"min_p": -0.5}, {"min_p": 1.01}, {"min_p": float("nan")}):
        with pytest.raises(ValueError):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError):
        sample(_logits(batch=2), [SamplingParams()], [0], EOS)


def test_a_race_that_fails_to_compile_falls_back_to_the_eager_race(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no host compiler")

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: broken)
    sampler._cuda_race.cache_clear()
    try:
        assert sampler._cuda_race(torch.device("cpu"), VOCAB) is sampler._race
    finally:
        sampler._cuda_race.cache_clear()
    assert "no host compiler" in caplog.text and "eager race" in caplog.text


def test_temperatures_beyond_float32_keep_eos_masked_and_top_k_greedy():
    # 1e39 and 1e300 are inf in float32: -inf / inf would be NaN, which argmax picks (an eos inside
    # min_tokens); and logits / 1e39 all round to 0, so top-k must be taken on the logits themselves.
    logits = _logits(batch=1) * 3
    logits[0, EOS] = 50.0
    best = [int(t) for t in logits[0].sort(descending=True).indices if t not in EOS][0]
    for t in (1e39, 1e300):
        drawn = sample(logits.expand(64, -1), [SamplingParams(temperature=t, min_tokens=5, seed=s) for s in range(64)],
                       [0] * 64, EOS)
        assert not set(drawn) & set(EOS) and len(set(drawn)) > 10  # uniform over the rest
        for kwargs in ({"top_k": 1}, {"top_p": 1e-9}, {"top_k": 1, "top_p": 1e-9}):
            assert sample(logits, [SamplingParams(temperature=t, min_tokens=5, seed=1, **kwargs)], [0], EOS) == [best]
    # Logits 1e-5 apart divided by 3e38 land on one float32 subnormal: the filters compare the logits.
    close = (1e-3 - torch.arange(VOCAB, dtype=torch.float32) * 1e-8)[None, :]
    for kwargs in ({"top_k": 1}, {"top_k": 2, "top_p": 0.03}, {"top_p": 0.01}):
        drawn = sample(close.expand(32, -1), [SamplingParams(temperature=3e38, seed=s, **kwargs) for s in range(32)],
                       [0] * 32, [])
        assert set(drawn) == {0}, kwargs

