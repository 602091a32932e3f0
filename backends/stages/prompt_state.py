"""A prompt in the encode_prefill stage, from its registration to the end of its prefill.

Its embeddings are made a prefill chunk at a time, when the chunk runs: the chunk's token ids through the language
model's embedding table, then the visual rows of its media groups in place of their pad tokens' rows. A group's merged
visual embeddings are held from its encode (or taken from the encoder cache) until prefill has passed them, so the
tokens of a cached prefix are never embedded and no ``[L, hidden]`` buffer is made for a long prompt.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import torch

from backends.ipc.protocol import NewRequest, PromptLogprobs, SamplingParams


@dataclass
class PromptState:
    """``input_ids``: the prompt, int64 ``[L]`` on the CPU; ``positions``: its rotary positions, int64
    ``[position_rows, L]`` on the CPU (the family's ``prompt_positions``); ``mrope_delta``: the offset of the decode
    positions (0 for 1-D RoPE); ``request``: what registered it; ``visual``: merged visual embeddings
    ``[n, hidden]`` (the model's dtype, on its device) by the index of their first token, one entry per media group
    encoded or found in the encoder cache, each kept until a chunk has prefilled its last token; ``grammar``: its
    structured output's matcher being made (``backends.runtime.sampling.grammar``), for its first token; ``scores``:
    the prompt log probabilities of the chunks prefilled so far (``SamplingParams.prompt_logprobs``; float32
    ``[m, 2 + 2 * top]`` each, on the device: ``ModelRunner.prefill_scored``)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    mrope_delta: int
    request: NewRequest
    visual: dict[int, torch.Tensor] = field(default_factory=dict)
    grammar: Future | None = None
    scores: list[torch.Tensor] = field(default_factory=list)

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    def chunk(self, start: int, end: int, embed: Callable[[torch.Tensor], torch.Tensor]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings ``[end - start, hidden]`` and positions int64 ``[position_rows, end - start]`` of tokens
        ``[start, end)``: ``embed`` (int64 ``[n]`` on the CPU -> a writable ``[n, hidden]``, e.g.
        ``ModelRunner.embed``) of the chunk's ids, with each row of a group in :attr:`visual` replaced by the group's.
        Groups that end by ``end`` are dropped: prefill runs each token once, in order."""
        embeds = embed(self.input_ids[start:end])
        for offset, rows in list(self.visual.items()):
            lo, hi = max(start, offset), min(end, offset + rows.shape[0])
            if lo < hi:
                embeds[lo - start:hi - start] = rows[lo - offset:hi - offset]
            if offset + rows.shape[0] <= end:
                del self.visual[offset]
        return embeds, self.positions[:, start:end]

    def next_ids(self, start: int, end: int) -> torch.Tensor | None:
        """The prompt tokens that follow positions ``[start, end)`` (int64, ``end - start`` of them, one fewer at the
        prompt's end) where the request asks for its prompt's log probabilities, else None."""
        return None if self.sampling.prompt_logprobs is None else self.input_ids[start + 1:end + 1]

    def prompt_logprobs(self) -> PromptLogprobs | None:
        """The whole prompt's log probabilities from :attr:`scores`, brought to the host (after the prompt's last
        chunk), or None where the request did not ask."""
        top = self.sampling.prompt_logprobs
        if top is None:
            return None
        figures = torch.cat(self.scores) if self.scores else torch.zeros(0, 2 + 2 * top)
        return PromptLogprobs(figures.cpu().numpy().tobytes(), top)
