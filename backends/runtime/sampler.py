"""Token sampling with per-request parameters in one batch: greedy, temperature, top-k, top-p, seeds.

A seeded draw is a pure function of ``(seed, num_generated)`` and the logits: the generator is seeded
from both, so the prefill worker (first token) and the decode worker (the rest) continue one stream.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Mixes num_generated into the seed (a large odd 64-bit constant, as in splitmix64) so that
# neighbouring (seed, step) pairs give unrelated streams.
_STEP_MIX = 0x9E3779B97F4A7C15
_SEED_MASK = (1 << 63) - 1


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. Raises ValueError for values out of range.

    * ``temperature``: 0 means greedy (argmax); otherwise logits are divided by it.
    * ``top_p``: keep the smallest set of most likely tokens whose probability reaches ``top_p`` (1 = off).
    * ``top_k``: keep the ``top_k`` most likely tokens (0 = off).
    * ``seed``: makes the draw reproducible (``None``: the process's global RNG).
    * ``min_tokens``: eos ids are masked while fewer tokens than this have been generated.
    * ``ignore_eos``: eos does not end the request (the caller's rule; the sampler does not mask it).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")


def _filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities ``[V]`` (float32) after temperature, top-k and top-p."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Drop a token when the tokens more likely than it already reach top_p; the top one always stays.
        drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= params.top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return probs


def _generator(seed: int, num_generated: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * _STEP_MIX + num_generated) & _SEED_MASK)
    return generator


def sample(logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int],
           eos_ids: list[int]) -> list[int]:
    """One token id per row.

    ``logits``: float32 ``[b, V]``; ``params``/``num_generated``: per row, ``num_generated`` being the
    tokens the request has generated before this one (0 for the first). ``eos_ids`` are masked for rows
    with ``num_generated < min_tokens``. Raises ValueError when the lengths disagree.
    """
    if not (logits.shape[0] == len(params) == len(num_generated)):
        raise ValueError(f"{logits.shape[0]} logit rows, {len(params)} params, {len(num_generated)} counts")
    logits = logits.float()
    masked_rows = [i for i, (p, n) in enumerate(zip(params, num_generated)) if n < p.min_tokens]
    if masked_rows and eos_ids:
        rows = torch.tensor(masked_rows, device=logits.device)[:, None]
        logits = logits.index_put((rows, torch.tensor(eos_ids, device=logits.device)[None, :]),
                                  torch.tensor(-math.inf, device=logits.device))
    greedy = logits.argmax(dim=-1).tolist()  # one device sync for the whole batch
    tokens = []
    for row, p, n, best in zip(logits, params, num_generated, greedy):
        if p.temperature == 0:
            tokens.append(best)
            continue
        generator = _generator(p.seed, n, row.device) if p.seed is not None else None
        tokens.append(int(torch.multinomial(_filtered_probs(row, p), 1, generator=generator)))
    return tokens
