"""Repetition, presence and frequency penalties, as vLLM's sampler applies them, batched per step on the logits'
device with per-row parameters.

The formula (vLLM's ``apply_penalties``, ``vllm/model_executor/layers/utils.py``, in its order): for a token seen
in the prompt or the output so far, a logit > 0 is divided by ``repetition_penalty`` and any other multiplied by it
(transformers' ``RepetitionPenaltyLogitsProcessor`` over prompt + output); then ``logits -= frequency_penalty *
count`` and ``logits -= presence_penalty * (count > 0)``, ``count`` being the token's occurrences in the output
(OpenAI's definition). Only rows with a penalty are touched: a step without one costs nothing here.

The first token (encode_prefill) has no output yet, so only the repetition penalty over the prompt applies
(:func:`penalize_first_tokens`). Decode keeps each penalized sequence's output counts on the device
(:class:`PenaltyState`), updated from each step's sampled tokens on the device, so an overlapped step (launched
before the last one's tokens reach the host) sees every token launched before it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Container, Iterable

import torch

from backends.ipc.protocol import SamplingParams
from backends.runtime.sampling.sampler import upload


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, prompt_mask: torch.Tensor, counts: torch.Tensor | None,
                    params: torch.Tensor) -> torch.Tensor:
    """A float32 copy of ``logits`` (``[b, V]``, any floating dtype, not changed) with ``rows`` penalized.

    ``rows``: int64 ``[p]``, distinct rows of ``logits``; ``prompt_mask``: bool ``[p, V]``, the tokens of each
    row's prompt; ``counts``: int32 ``[p, V]``, each token's occurrences in the row's output so far, or None for
    none (the first token); ``params``: float32 ``[p, 3]``, each row's ``(repetition, presence, frequency)``
    penalties. All on the logits' device; nothing waits for it. Formula: the module docstring.
    """
    out = logits.to(torch.float32, copy=True)
    x = out.index_select(0, rows)
    repetition, presence, frequency = (params[:, i, None] for i in range(3))
    seen = prompt_mask if counts is None else prompt_mask | (counts > 0)
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    if counts is not None:
        x -= frequency * counts
        x -= presence * (counts > 0)
    return out.index_copy_(0, rows, x)


def _param_row(sampling: SamplingParams) -> list[float]:
    return [sampling.repetition_penalty, sampling.presence_penalty, sampling.frequency_penalty]


def penalize_first_tokens(logits: torch.Tensor, prompts: list[tuple[int, ...]],
                          params: list[SamplingParams]) -> torch.Tensor:
    """The logits of prompts' first output tokens with each row's repetition penalty over its prompt applied.

    ``logits``: floating ``[b, V]``; ``prompts[i]``: row i's prompt token ids (each below V); ``params[i]``: its
    sampling. Returns ``logits`` itself when no row has a repetition penalty, else a float32 copy
    (:func:`apply_penalties`). Raises ValueError when the lengths disagree.
    """
    if not logits.shape[0] == len(prompts) == len(params):
        raise ValueError(f"{logits.shape[0]} logit rows, {len(prompts)} prompts, {len(params)} params")
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1]
    if not rows:
        return logits
    ids = [set(prompts[i]) for i in rows]  # a video prompt repeats its pad token thousands of times
    # one upload: the rows, then each id's row among the penalized rows, then the ids
    packed = upload(torch.tensor([*rows, *(j for j, row_ids in enumerate(ids) for _ in row_ids),
                                  *(t for row_ids in ids for t in row_ids)]), logits.device)
    rows_t, mask_rows, mask_cols = packed.split([len(rows), *[sum(map(len, ids))] * 2])
    mask = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool, device=logits.device)
    mask.index_put_((mask_rows, mask_cols), torch.ones_like(mask_cols, dtype=torch.bool))
    table = upload(torch.tensor([_param_row(params[i]) for i in rows], dtype=torch.float32), logits.device)
    return apply_penalties(logits, rows_t, mask, None, table)


@dataclass(frozen=True)
class PenalizedRows:
    """The rows of a step that :meth:`PenaltyState.penalize` penalized (int64 ``[p]`` on the device) and their
    sequences' slots (int64 ``[p]``), for :meth:`PenaltyState.count`."""

    rows: torch.Tensor
    slots: torch.Tensor


class PenaltyState:
    """Per-sequence penalty state of the decode batch, on ``device``, for sequences with a penalty only.

    A slot per penalized sequence in three tables: output token counts (int32 ``[slots, V]``), the prompt's
    tokens (bool ``[slots, V]``) and the penalties (float32 ``[slots, 3]``), about 5 bytes x V per sequence (0.76
    MB for Qwen2.5-VL's 152k tokens). The tables are made at the first penalized sequence and double when full.
    All of it runs on the decode loop thread, and every device write is queued on the one stream in call order:
    a slot freed while a launched step still counts into it is re-initialised only after that step.
    """

    def __init__(self, vocab: int, device: torch.device):
        self.vocab, self.device = vocab, device
        self.slots: dict[str, int] = {}  # seq_id -> slot
        self._free: list[int] = []
        self.counts = torch.zeros(0, vocab, dtype=torch.int32, device=device)
        self.prompt = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        self.params = torch.zeros(0, 3, dtype=torch.float32, device=device)

    def add(self, seq_id: str, sampling: SamplingParams, prompt_token_ids: tuple[int, ...],
            output_token_ids: tuple[int, ...]) -> None:
        """Give ``seq_id`` a slot when ``sampling`` has a penalty (else nothing): its prompt's token ids and the
        output tokens it has already made (ids below V; repeats count). A ``seq_id`` that has a slot gets it anew."""
        if not sampling.penalized:
            return
        slot = self.slots.get(seq_id)
        if slot is None:
            if not self._free:
                self._grow()
            slot = self.slots[seq_id] = self._free.pop()
        packed = upload(torch.tensor([*_param_row(sampling), *prompt_token_ids, *output_token_ids],
                                     dtype=torch.float64), self.device)  # token ids are exact in float64
        params, prompt_ids, output_ids = packed.split([3, len(prompt_token_ids), len(output_token_ids)])
        self.params[slot] = params
        self.prompt[slot].zero_().index_fill_(0, prompt_ids.long(), True)
        self.counts[slot].zero_().index_add_(0, output_ids.long(), torch.ones_like(output_ids, dtype=torch.int32))

    def retain(self, seq_ids: Container[str]) -> None:
        """Free the slots of sequences not in ``seq_ids`` (a container of seq_ids: those still running)."""
        for seq_id in [s for s in self.slots if s not in seq_ids]:
            self._free.append(self.slots.pop(seq_id))

    def penalize(self, logits: torch.Tensor, seq_ids: Iterable[str]) -> tuple[torch.Tensor, PenalizedRows | None]:
        """``logits`` (floating ``[b, V]``, row i being the next token of the i-th of ``seq_ids``, which is not read
        while no sequence has a slot) with the penalties of the rows that have a slot applied (a float32 copy,
        :func:`apply_penalties`), and those rows for :meth:`count`; the logits themselves and None when no row has
        one. Nothing waits for the device."""
        if not self.slots:
            return logits, None
        pairs = [(i, self.slots[seq_id]) for i, seq_id in enumerate(seq_ids) if seq_id in self.slots]
        if not pairs:
            return logits, None
        rows_t, slots_t = upload(torch.tensor(pairs), self.device).unbind(1)
        penalized = apply_penalties(logits, rows_t, self.prompt.index_select(0, slots_t),
                                    self.counts.index_select(0, slots_t), self.params.index_select(0, slots_t))
        return penalized, PenalizedRows(rows_t, slots_t)

    def count(self, penalized: PenalizedRows | None, tokens: torch.Tensor) -> None:
        """Add the step's sampled ``tokens`` (int64 ``[b]`` on the device, as the sampler returns them) of the rows
        :meth:`penalize` penalized to their sequences' counts, on the device."""
        if penalized is None:
            return
        self.counts.index_put_((penalized.slots, tokens.index_select(0, penalized.rows)),
                               torch.ones_like(penalized.slots, dtype=torch.int32), accumulate=True)

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(8, 2 * old)
        self.counts = torch.cat([self.counts, self.counts.new_zeros(new - old, self.vocab)])
        self.prompt = torch.cat([self.prompt, self.prompt.new_zeros(new - old, self.vocab)])
        self.params = torch.cat([self.params, self.params.new_zeros(new - old, 3)])
        self._free.extend(range(new - 1, old - 1, -1))
