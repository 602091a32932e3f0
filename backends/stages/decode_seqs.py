"""The decode batch's records: a running sequence (``RunningSeq``) and a step launched but not yet read
(``Launched``), kept by ``backends.stages.decode_worker``'s loop thread; the shapes of what a step sends."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from backends.ipc.protocol import DecodeAdmit, DecodeStep, SamplingParams, TokenLogprobs
from backends.runtime.sampling.logprobs import Asked
from backends.runtime.sampling.token_readback import TokenReadback

# One decode step's output for all sequences (``DecodeStep``).
StepSink = Callable[[DecodeStep], None]
# (sequences in the step, the seconds it took: from its launch, or from the last step's tokens on the host if that
# came later, to its tokens on the host; whether the batch is empty after it): one call per step, on the send
# thread after the step's message; also (0, 0.0, idle) when the batch may have emptied without a step (abort,
# end) and at shutdown.
StepTimer = Callable[[int, float, bool], None]
# One sequence's row of a step's message: (seq_id, token_id, finish_reason, its logprobs or None).
Row = tuple[str, int, str, TokenLogprobs | None]


@dataclass
class RunningSeq:
    """A sequence in the decode batch. ``num_cached`` tokens are in the KV pool, or will be once the step in
    flight has run; ``last_token`` is not yet (while the sequence is in the step in flight, ``last_token`` is
    the one before and the current one is on the device). ``num_generated`` counts the tokens of launched steps;
    ``ending``: the step in flight makes its ``max_tokens``-th token, so it is not launched again.
    ``prompt_token_ids``: the admission's (``DecodeAdmit``), for the penalty state. ``grammar``: its structured
    output's xgrammar matcher (``backends.runtime.sampling.grammar``), having accepted every token read so far."""

    seq_id: str
    block_table: np.ndarray  # int32: the KV pages granted (a step's page list is views of these)
    num_cached: int
    last_token: int
    mrope_delta: int
    num_generated: int
    max_tokens: int
    sampling: SamplingParams
    ending: bool = False
    prompt_token_ids: tuple[int, ...] = ()
    grammar: Any = None

    def may_step(self, page_size: int) -> bool:
        """It has a token left to make and a KV page (of ``page_size`` tokens) for that token's KV."""
        return not self.ending and self.num_cached < len(self.block_table) * page_size

    def extend(self, pages: tuple[int, ...]) -> None:
        """Append KV pages granted since admission (``DecodeGrow``)."""
        self.block_table = np.concatenate([self.block_table, np.asarray(pages, dtype=np.int32)])

    @classmethod
    def from_admit(cls, admit: DecodeAdmit) -> "RunningSeq":
        """From the orchestrator's admit message (its matcher comes later: ``decode_grammars``)."""
        return cls(admit.seq_id, np.asarray(admit.block_table, dtype=np.int32), admit.num_cached, admit.last_token,
                   admit.mrope_delta, admit.num_generated, admit.max_tokens, admit.sampling,
                   prompt_token_ids=admit.prompt_token_ids)


@dataclass(frozen=True)
class Launched:
    """A step launched on the device whose tokens the host has not read: its sequences in row order, each row's
    ``num_generated`` before the step, the sampled tokens (with the asking rows' log probabilities), and the rows
    that asked for them (None: none did)."""

    seqs: list[RunningSeq]
    counts: list[int]
    tokens: TokenReadback
    started: float  # time.perf_counter() at launch
    asked: Asked | None = None

