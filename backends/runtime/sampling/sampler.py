"""Token sampling with per-request parameters in one batch: greedy, temperature, min-p, top-k, top-p, seeds.

The whole batch is a fixed number of tensor ops on the logits' device (CPU or CUDA), whatever its size;
the one device->host sync is the ``.tolist()`` in ``sample``. A draw is the exponential race, i.e. the
Gumbel-max trick in exponential form: ``argmax(probs / E)`` with ``E_i = -log U_i`` i.i.d. Exp(1) picks
token ``i`` with probability ``probs[i] / sum(probs)`` (Gumbel 1954; Maddison et al. 2014, "A* Sampling",
section 2); exactly so for continuous ``U``, up to ``U``'s 23 bits here (two smallest ``E`` tie in under
1% of draws over 152k equally likely tokens, and the lower token id wins). ``U`` is not drawn from a
generator's state but hashed from ``(seed, num_generated, token id)`` (a counter-based RNG), so a seeded
draw is a pure function of ``(seed, num_generated)`` and the row's logits: the prefill worker (first
token) and the decode worker (the rest) continue one stream, and no row depends on which others share its
batch (but for float rounding where a top-p edge falls within it: a reduction's last bit can depend on the
batch's shape).
"""
from __future__ import annotations

import functools
import logging
import math
import random

import torch

from backends.ipc.protocol import SamplingParams

log = logging.getLogger(__name__)
_M32 = (1 << 32) - 1
_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment: 2**64 / golden ratio, odd
# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): logits / 1e-38 would overflow float32.
GREEDY_BELOW_TEMPERATURE = 1e-5
_TOP_P_OFF = 1 - 2 ** -25  # float32 rounds top_p from here up to 1.0: off
_SYSTEM_RANDOM = random.SystemRandom()  # unseeded rows: the loader seeds torch's global RNG, so not that


def _splitmix64(state: int) -> int:
    """splitmix64's output function on a Python int (Steele, Lea & Flood 2014, "Fast splittable
    pseudorandom number generators"; constants from Vigna's splitmix64.c)."""
    z = state & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _row_key(seed: int, num_generated: int) -> int:
    """The 32-bit key of one draw: the top half of output number ``num_generated`` (from 0) of a splitmix64
    generator seeded with ``seed``. Exact Python-int arithmetic, on the host."""
    return _splitmix64(seed + (num_generated + 1) * _GAMMA) >> 32


def _mul32(x, c: int):
    """``x * c mod 2**32`` for ``0 <= x < 2**32``, on a Python int or an int64 tensor (in place).

    No intermediate reaches 2**63, so int64 tensors never overflow and the result is exact on any device:
    a 32-bit times a 31-bit number is below 2**63, and for ``c >= 2**31``, ``x * 2**31 = (x & 1) << 31``
    (mod 2**32).
    """
    if c < 1 << 31:
        x *= c
    else:
        odd = (x & 1) << 31
        x *= c - (1 << 31)
        x += odd
    x &= _M32
    return x


def _lowbias32(x):
    """The lowbias32 integer hash, a bijection of [0, 2**32) (C. Wellons, "Prospecting for Hash Functions",
    2018, hash-prospector). Takes a Python int or an int64 tensor with values in [0, 2**32), which it
    changes in place; shifts of non-negative values are logical, so no masking is needed after them."""
    x ^= x >> 16
    x = _mul32(x, 0x7FEB352D)
    x ^= x >> 15
    x = _mul32(x, 0x846CA68B)
    x ^= x >> 16
    return x


@functools.lru_cache(maxsize=8)
def _token_hash(vocab: int, device: torch.device) -> torch.Tensor:
    """``lowbias32(token id)``, int64 ``[vocab]`` on ``device``: the first of the two hash rounds, shared by
    all rows and calls."""
    return _lowbias32(torch.arange(vocab, dtype=torch.int64, device=device))


def _exponentials(keys: torch.Tensor, token_hash: torch.Tensor) -> torch.Tensor:
    """``E = -log U``, float32 ``[s, V]``, with ``U = uniform(lowbias32(lowbias32(token) ^ key))``.

    ``keys``: int64 ``[s]`` in [0, 2**32); ``token_hash``: :func:`_token_hash`, int64 ``[V]``.
    ``U = ((h >> 9) + 0.5) / 2**23`` lies in (0, 1) and is exact in float32, so ``U`` is bit-identical on CPU
    and CUDA; ``log`` may differ there by an ulp.
    """
    h = _lowbias32(token_hash[None, :] ^ keys[:, None])
    return (h >> 9).float().add_(0.5).mul_(2.0 ** -23).log_().neg_()


def _race(scores: torch.Tensor, keys: torch.Tensor, token_hash: torch.Tensor) -> torch.Tensor:
    """The exponential race in log form: ``argmax(scores - log E)`` per row, int64 ``[s]``.

    ``scores``: float32 ``[s, V]``, log-weights up to a per-row constant (logits / temperature, -inf for
    filtered tokens), so ``argmax(probs / E) = argmax(scores - log E)`` and no softmax is needed.
    """
    return (scores - _exponentials(keys, token_hash).log_()).argmax(dim=-1)


@functools.lru_cache(maxsize=8)
def _cuda_race(device: torch.device, vocab: int):
    """:func:`_race` compiled by ``torch.compile`` for ``vocab``-wide rows on ``device``: one generated kernel
    (hash, log, argmax) where the eager race is about 25 elementwise kernels over int64 ``[s, V]`` (a whole
    temperature draw takes several times less GPU time than the eager race alone: bench/RESULTS.md, "sampler,
    baselines").

    Compiled here, under ``torch.no_grad`` as :func:`sample_tensor` calls it, for 1 row and for 2 (dynamic
    shapes: every batch size from 2 shares that compilation). A caller under ``torch.inference_mode`` would
    make it compile once more (seconds); the stages call the sampler outside it. CUDA uses it whatever the
    batch, so a row's token cannot depend on which race its batch took. Where compiling fails (e.g. no host
    compiler for Triton's launcher), logs why and returns the eager :func:`_race` (the same tokens but for
    ``log``'s last bit).
    """
    compiled = torch.compile(_race, dynamic=True)
    try:
        with torch.no_grad():
            for rows in (1, 2):
                compiled(torch.zeros(rows, vocab, device=device), torch.zeros(rows, dtype=torch.int64, device=device),
                         _token_hash(vocab, device))
    except Exception as exc:  # noqa: BLE001 - any compiler failure: the eager race draws the same way
        log.warning("sampler: torch.compile of the race failed on %s (%s: %s); drawing with the eager race",
                    device, type(exc).__name__, exc)
        return _race
    return compiled


@functools.lru_cache(maxsize=1)
def _flashinfer_top_p():
    """flashinfer's ``top_p_renorm_probs``, or None where flashinfer is not installed (looked up once)."""
    try:
        from flashinfer.sampling import top_p_renorm_probs
    except ImportError:
        return None
    return top_p_renorm_probs


def _top_k_mask(scores: torch.Tensor, top_k: torch.Tensor, k_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``scores`` with ``-inf`` below each row's k-th highest score (ties with it stay), in place, and the
    ``k_max`` highest scores of each row, sorted, masked the same way: float32 ``[s, V]`` and ``[s, k_max]``.
    ``top_k`` int64 ``[s]`` in [1, V] (V = off); ``k_max``: the largest top-k below V. The k-th score comes
    from ``torch.topk``, not from a sort of the vocabulary."""
    ranked = scores.topk(k_max, dim=-1).values
    kth = ranked.gather(1, (top_k.clamp(max=k_max) - 1)[:, None])
    kth.masked_fill_((top_k >= scores.shape[1])[:, None], -math.inf)
    return scores.masked_fill_(scores < kth, -math.inf), ranked.masked_fill_(ranked < kth, -math.inf)


def _min_p_mask(scores: torch.Tensor, log_min_p: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``scores`` with ``-inf`` where a token is less than ``min_p`` times as likely as its row's most likely token at
    the row's temperature, in place: float32 ``[s, V]``; ``log_min_p`` float32 ``[s]`` (``ln min_p``, -inf: off);
    ``temperature`` float32 ``[s, 1]``. ``p_i / p_max = exp((l_i - l_max) / T)``, so a token stays where
    ``l_i >= l_max + T ln(min_p)``: no softmax, and the most likely token (and any tied with it) always stays. The
    rule is vLLM's ``min_p`` (its probabilities' ratio to the largest, at the temperature)."""
    floor = scores.amax(dim=-1, keepdim=True).addcmul_(temperature, log_min_p[:, None])
    return scores.masked_fill_(scores < floor, -math.inf)


def _top_p_threshold(logits: torch.Tensor, ranked: torch.Tensor, top_p: torch.Tensor,
                     temperature: torch.Tensor) -> torch.Tensor:
    """The logit each row's top-p keeps down to, float32 ``[s, 1]``: the last of the sorted logits whose more
    likely tokens hold less than ``top_p`` of the probability (-inf where ``top_p`` is inf, i.e. off).

    ``logits``: float32 ``[s, V]`` (-inf where top-k dropped a token); ``ranked``: float32 ``[s, c]``, each
    row's highest logits sorted in descending order, among them every token the row can keep (the whole
    vocabulary sorted, or top-k's candidates when the row has a top-k; tokens tied with the k-th beyond the
    candidates count in the normaliser, and stay, being at the threshold); ``top_p`` float32 ``[s]``;
    ``temperature`` float32 ``[s, 1]``, which makes the probabilities (``softmax(logits / temperature)``,
    normalised relative to the top logit: logits / 1e-5 reach 1e6, where float32's log-sum-exp is off by
    percents). A row with no finite logit (NaN) gets its first ranked logit, not an out-of-range index.
    """
    top = ranked[:, :1]
    log_norm = ((logits - top) / temperature).logsumexp(dim=-1, keepdim=True)
    probs = ((ranked - top) / temperature - log_norm).exp_()
    count = ((probs.cumsum(dim=-1) - probs) < top_p[:, None]).sum(dim=-1, keepdim=True).clamp_(min=1)
    return ranked.gather(1, count - 1).masked_fill_(top_p[:, None] > 1, -math.inf)


def _top_p_mask(logits: torch.Tensor, top_p: torch.Tensor, temperature: torch.Tensor,
                ranked: torch.Tensor | None = None) -> torch.Tensor:
    """``logits`` with ``-inf`` where top-p drops a token, in place: float32 ``[s, V]``; ``top_p`` float32 ``[s]``
    (inf = off); ``temperature`` float32 ``[s, 1]``; ``ranked``: top-k's sorted candidates
    (:func:`_top_k_mask`) when every row here has a top-k.

    The rule (:class:`SamplingParams`): a token stays when the tokens strictly more likely than it hold less
    than ``top_p`` of the probability, so ties stay and the most likely token always does. Tokens are compared
    by logit, which orders them as their probabilities do at any temperature, also where ``logits /
    temperature`` rounds apart logits to one value. The threshold comes from ``ranked`` when given; else, on
    CUDA, from flashinfer's ``top_p_renorm_probs`` (radix select, ``is_deterministic=True``: a whole top-p
    draw takes about half the GPU time of the sort alone, bench/RESULTS.md, "sampler, baselines"); else (CPU, or no
    flashinfer) from a sort of the vocabulary.
    flashinfer and the sort can disagree on the last token kept where the running sum meets ``top_p`` within
    float rounding. :func:`sample_tensor` passes ``ranked`` for the rows with a top-k and calls again for the
    others alone, so a row's rule never depends on its batch.
    """
    top_p_renorm_probs = _flashinfer_top_p() if ranked is None and logits.is_cuda else None
    if top_p_renorm_probs is not None:
        # NaN rows (no finite logit) enter as zeros: flashinfer's search is not written for NaN
        probs = (logits / temperature).softmax(dim=-1).nan_to_num_(0.0)
        kept = top_p_renorm_probs(probs, top_p.clamp(max=1.0), is_deterministic=True) > 0
        return logits.masked_fill_(~kept.logical_or_((top_p > 1)[:, None]), -math.inf)
    if ranked is None:
        ranked = logits.sort(dim=-1, descending=True).values
    return logits.masked_fill_(logits < _top_p_threshold(logits, ranked, top_p, temperature), -math.inf)


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One host->device copy that does not wait for the device (pinned memory on CUDA)."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def sample_tensor(logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int],
                  eos_ids: list[int]) -> torch.Tensor:
    """One token id per row, int64 ``[b]`` on the logits' device, without a device->host sync.

    ``logits``: floating ``[b, V]`` (read, not changed); ``params``/``num_generated``: per row,
    ``num_generated`` being the tokens the request has generated before this one (0 for the first).
    ``eos_ids`` and the row's ``stop_token_ids`` (ids below V) are masked for rows with ``num_generated <
    min_tokens``. Greedy rows (temperature below :data:`GREEDY_BELOW_TEMPERATURE`) take the argmax (the first on
    ties); the others are drawn as the module docstring says, a seeded row's token being a function of its seed,
    ``num_generated`` and logits row alone.
    The same inputs give the same token on CPU and CUDA except where two float scores tie within rounding
    (``log`` may differ by an ulp between devices) or, on CUDA, where flashinfer's top-p keeps one token fewer
    or more at its edge (:func:`_top_p_mask`). On CUDA the first drawn call compiles the race (seconds) unless
    :func:`warm_up` did. Raises ValueError when the lengths disagree.
    """
    if not (logits.shape[0] == len(params) == len(num_generated)):
        raise ValueError(f"{logits.shape[0]} logit rows, {len(params)} params, {len(num_generated)} counts")
    device, vocab = logits.device, logits.shape[1]
    logits = logits.float()
    banned = [n < p.min_tokens for p, n in zip(params, num_generated)]
    if any(banned) and (cols := list(dict.fromkeys(
            [*eos_ids, *(t for p, b in zip(params, banned) if b for t in p.stop_token_ids)]))):
        # Row i masks column j where i is banned and j is an eos id or one of row i's stop_token_ids. Not
        # `logits[rows, cols] = -inf`: that assignment waits for the device.
        mask = torch.tensor([[b and (c in eos_ids or c in p.stop_token_ids) for c in cols]
                             for p, b in zip(params, banned)])
        mask, cols = upload(mask, device), upload(torch.tensor(cols), device)
        stop_logits = logits.index_select(1, cols).masked_fill_(mask, -math.inf)
        logits = logits.index_copy(1, cols, stop_logits)
    tokens = logits.argmax(dim=-1)
    drawn = [i for i, p in enumerate(params) if p.temperature >= GREEDY_BELOW_TEMPERATURE]
    if not drawn:
        return tokens
    # One row per drawn request: [row, temperature, top_p, top_k, key, ln min_p], all exact in float64.
    table = []
    for i in drawn:
        p = params[i]
        seed = p.seed if p.seed is not None else _SYSTEM_RANDOM.getrandbits(63)
        table.append((i, p.temperature, p.top_p if p.top_p < _TOP_P_OFF else math.inf,
                      p.top_k if 0 < p.top_k < vocab else vocab, _row_key(seed, num_generated[i]),
                      math.log(p.min_p) if p.min_p > 0 else -math.inf))
    k_max = max((t[3] for t in table if t[3] < vocab), default=0)
    min_p = any(t[5] > -math.inf for t in table)
    # t[2]: top_p, inf when off. A row's top-p takes its threshold from top-k's candidates when the row has a
    # top-k, else from flashinfer (CUDA) or a sort: chosen by the row's own parameters, never by its company.
    top_p_with_k = any(t[2] < 1 and t[3] < vocab for t in table)
    top_p_alone = [j for j, t in enumerate(table) if t[2] < 1 and t[3] == vocab]
    table = upload(torch.tensor(table, dtype=torch.float64), device)
    rows, top_p, top_k = table[:, 0].long(), table[:, 2].float(), table[:, 3].long()
    # contiguous even for one row (a one-element column keeps the table's row stride), as the race was compiled for
    keys = table[:, 4].to(torch.int64, memory_format=torch.contiguous_format)
    # Beyond float32's range a temperature acts as its largest: uniform over the kept tokens, never inf / inf.
    temperature = table[:, 1, None].float().clamp_(max=torch.finfo(torch.float32).max)
    scores = logits[rows]  # filtered as logits: their order is the probabilities' at any temperature
    if min_p:  # first, as vLLM orders them: top-k and top-p see only the tokens it kept
        scores = _min_p_mask(scores, table[:, 5].float(), temperature)
    if k_max:
        scores, ranked = _top_k_mask(scores, top_k, k_max)
        if top_p_with_k:
            scores = _top_p_mask(scores, top_p.masked_fill(top_k == vocab, math.inf), temperature, ranked)
    if top_p_alone:
        alone = upload(torch.tensor(top_p_alone), device)
        scores.index_copy_(0, alone, _top_p_mask(scores.index_select(0, alone), top_p.index_select(0, alone),
                                                 temperature.index_select(0, alone)))
    scores.div_(temperature)
    race = _cuda_race(device, vocab) if device.type == "cuda" else _race
    with torch.no_grad():  # as _cuda_race compiled it: the same global state, no recompilation
        return tokens.index_copy_(0, rows, race(scores, keys, _token_hash(vocab, device)))


def warm_up(device: torch.device, vocab: int) -> None:
    """Compile the CUDA race for ``vocab``-wide logits (:func:`_cuda_race`) and load flashinfer's top-p kernel
    (built by flashinfer's JIT on a machine's first use: bench/RESULTS.md, "sampler warm-up") before a
    request needs them, by drawing once with top-p; a no-op off CUDA."""
    if device.type == "cuda":
        log.info("compiling the sampler and loading flashinfer's top-p kernel (built once per machine)")
        sample(torch.zeros(2, vocab, device=device), [SamplingParams(top_p=0.5)] * 2, [0, 0], [])


def sample(logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int],
           eos_ids: list[int]) -> list[int]:
    """One token id per row, as ``sample_tensor`` (same arguments and errors), brought to the host with one
    device->host sync."""
    return sample_tensor(logits, params, num_generated, eos_ids).tolist()
