"""Log probabilities of sampled tokens, for the requests that ask (``SamplingParams.logprobs``).

A row's log probabilities are the log-softmax of its raw logits in float32: before penalties, the ``min_tokens``
mask, temperature, top-k and top-p (vLLM v1's default ``logprobs_mode``, ``raw_logprobs``). Per sampled token: its
log probability, its rank (the number of tokens at least as likely, itself included: vLLM v1's
``batched_count_greater_than``, so 1 is the most likely) and the ``logprobs`` most likely tokens with theirs.

The work is split around sampling so that nothing waits for the device: :func:`start` takes the log-softmax of
the asking rows before the logits are penalized (on their device; the rows picked by an index uploaded without a
sync, never by a Python list, whose copy to the device would wait for the step's forward), :func:`finish` gathers
the sampled tokens' figures into one float32 ``[n, 2 + 2k]`` tensor (token ids up to 2**24 are exact in float32;
vocabularies here are under 160,000), which the caller brings to the host with its tokens, and :func:`rows` turns
the host's copy into one :class:`TokenLogprobs` (or None) per row. :func:`prompt_figures` gives a prompt chunk's
positions the same figures for the prompt tokens that follow them (``SamplingParams.prompt_logprobs``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.ipc.protocol import SamplingParams, TokenLogprobs
from backends.runtime.sampling.sampler import upload

PROMPT_ROWS_AT_ONCE = 128  # prompt positions whose logits exist at once (prompt_figures): about 150 MB at its peak
                          # (float32 logits and logsumexp's temporary) for a 152,064-token vocabulary


@dataclass(frozen=True)
class Asked:
    """The batch rows whose ``SamplingParams.logprobs`` ask, in order, the most top tokens any of them asks for
    (``k``), and those rows as an int64 index on the logits' device (None: every row asks)."""

    rows: list[int]
    k: int
    index: torch.Tensor | None = None

    def picked(self, batch: torch.Tensor) -> torch.Tensor:
        """The asking rows of ``batch`` (``[b, ...]`` on the logits' device), in order."""
        return batch if self.index is None else batch.index_select(0, self.index)


def start(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[Asked, torch.Tensor] | None:
    """The asking rows (:class:`Asked`) and their log-softmax, float32 ``[n, V]`` on the logits' device, from
    ``logits`` (floating ``[b, V]``, read only); None when no row asks (then nothing is computed)."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return None
    index = None if len(rows) == logits.shape[0] else upload(torch.tensor(rows), logits.device)
    asked = Asked(rows, max(params[i].logprobs for i in rows), index)
    return asked, torch.log_softmax(asked.picked(logits).float(), dim=-1)


def finish(asked: Asked, logprobs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """float32 ``[n, 2 + 2k]`` on the device: per asking row, the sampled token's log probability and rank, then
    the ``k`` most likely token ids and their log probabilities (most likely first). ``logprobs``: :func:`start`'s
    tensor; ``tokens``: the sampled ids, int64 ``[b]`` (all rows)."""
    sampled = logprobs.gather(1, asked.picked(tokens)[:, None])
    rank = (logprobs >= sampled).sum(dim=-1, keepdim=True, dtype=torch.float32)
    parts = [sampled, rank]
    if asked.k:
        top = logprobs.topk(asked.k, dim=-1)
        parts += [top.indices.float(), top.values]
    return torch.cat(parts, dim=1)


def rows(asked: Asked | None, figures: list[list[float]], params: list[SamplingParams]
         ) -> list[TokenLogprobs | None]:
    """One entry per row of the batch (``params``): its :class:`TokenLogprobs` from ``figures`` (the host's copy
    of :func:`finish`'s tensor, as lists), with as many top tokens as it asked for, or None where it did not ask."""
    out: list[TokenLogprobs | None] = [None] * len(params)
    if asked is None:
        return out
    for row, values in zip(asked.rows, figures):
        top = tuple((int(values[2 + j]), values[2 + asked.k + j]) for j in range(params[row].logprobs))
        out[row] = TokenLogprobs(values[0], int(values[1]), top)
    return out


def prompt_figures(lm_head: torch.nn.Module, hidden: torch.Tensor, next_ids: torch.Tensor, top: int,
                   rows_at_once: int = PROMPT_ROWS_AT_ONCE) -> torch.Tensor:
    """A prompt chunk's log probabilities (``SamplingParams.prompt_logprobs``): float32 ``[m, 2 + 2 * top]`` on the
    device, per position the figures :func:`finish` gives a sampled token, for the prompt token that follows it.
    ``hidden``: the chunk's final hidden states ``[n, hidden]`` (model dtype, on the device); ``next_ids``: int64
    ``[m]`` on the CPU, m <= n, the prompt tokens its first m positions are followed by (the prompt's last position
    is followed by none). The logits (``lm_head``, float32, raw as the sampled tokens' are) are made
    ``rows_at_once`` rows at a time: a 2,048-token chunk's over a 152,064-token vocabulary would take 1.2 GB at once
    (and as much again for the log-softmax's temporaries). No host sync."""
    ids, out = upload(next_ids, hidden.device), []
    every_row = Asked([], top)  # index None: each slice's every row
    for lo in range(0, next_ids.shape[0], rows_at_once):
        hi = min(lo + rows_at_once, next_ids.shape[0])
        logprobs = lm_head(hidden[lo:hi]).float()
        logprobs -= torch.logsumexp(logprobs, dim=-1, keepdim=True)  # log-softmax in place: no output buffer
        out.append(finish(every_row, logprobs, ids[lo:hi]))
    return torch.cat(out) if out else torch.zeros(0, 2 + 2 * top, device=hidden.device)
