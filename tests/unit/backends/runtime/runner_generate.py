"""Greedy generation through a ModelRunner as the stages run it (chunked prefill into random KV pages, then one
decode step per token), and the comparison with transformers' generate(): shared by the families' tests."""
from __future__ import annotations

import random

import torch

from backends.runtime.language_model.kv_cache import pages_needed
from backends.runtime.model_runner import DecodeSeq, ModelRunner, PrefillChunk
from tests.reference import assert_same_or_tie


def runner_generate(runner: ModelRunner, embeds: torch.Tensor, positions: torch.Tensor, delta: int, new_tokens: int,
                    chunk: int, rng: random.Random) -> tuple[list[int], list[torch.Tensor]]:
    """``new_tokens`` greedy tokens after a prompt's ``embeds`` [L, hidden] and ``positions`` [rows, L] (``delta``:
    the decode position offset), prefilled ``chunk`` tokens at a time. Returns (token ids, per-step logits)."""
    length, page_size = embeds.shape[0], runner.page_size
    block_table = rng.sample(range(runner.kv_cache.shape[2]), pages_needed(length + new_tokens, page_size))
    logits = None
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        out = runner.prefill([PrefillChunk(embeds[start:end], positions[:, start:end], start, block_table,
                                           end == length)])
        logits = out[0] if len(out) else logits
    tokens, all_logits = [int(logits.argmax())], [logits]
    for step in range(1, new_tokens):
        index = length + step - 1
        logits = runner.decode([DecodeSeq(tokens[-1], index + delta, index, block_table)])[0]
        tokens.append(int(logits.argmax()))
        all_logits.append(logits)
    return tokens, all_logits


def assert_matches_reference(ours: list[int], theirs: list[int], our_logits: list[torch.Tensor],
                             ref_logits: list[torch.Tensor], tolerance: float = 1e-4) -> None:
    """Equal token ids (or a genuine tie at the first difference), with the logits within ``tolerance`` (relative
    and absolute) up to it."""
    for step, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(our_logits[step], ref_logits[step].float(), rtol=tolerance, atol=tolerance)
        if a != b:
            break
    assert_same_or_tie(ours, theirs, ref_logits)
