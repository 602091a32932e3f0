"""CUDA graphs for decode steps at a ladder of batch sizes (``graph_capture``: what they share with prefill graphs).

One graph per batch size of the ladder; a batch of ``n`` sequences replays the smallest graph of ``B >= n`` rows, the
``B - n`` padding rows reading and writing only the pool's reserved scratch page (``kv_cache.scratch_page``). All
graphs share one memory pool and flashinfer's workspace.

Per step, on the host: the paged layout is planned into the graph's fixed index buffers (flashinfer's
``use_cuda_graph`` mode), token ids, M-RoPE positions and KV positions go through one pinned buffer and one
asynchronous copy, then the graph replays. The step's only host sync is the caller's read of the
sampled tokens; token ids may also come from the device (the last step's samples), so that the caller can
launch a step before it reads the last one's tokens (``backends.runtime.sampling.token_readback``).

The plan does not depend on the tokens, so a caller may :meth:`DecodeGraphs.prepare` the next step's layout
while the GPU still runs this one (bench/RESULTS.md, "decode step, host part") and only fill in the token ids
once it has read them. For that the plan's copies are asynchronous (``graph_capture.LayoutStaging``). Before it
rewrites its pinned buffers, a plan waits for the copies of the plan before it: a caller that prepares and then
stages a different layout without reading the tokens in between waits for the running step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from backends.runtime.attention.base import AttentionMetadata
from backends.runtime.attention.flashinfer_backend import FlashInferAttentionBackend
from backends.runtime.language_model.graph_capture import CapturedGraphs, LayoutStaging, PinnedStaging, ladder, rung_for
from backends.runtime.language_model.kv_cache import scratch_page

if TYPE_CHECKING:
    from backends.runtime.model_runner import DecodeSeq, ModelRunner

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def batch_ladder(max_batch: int) -> tuple[int, ...]:
    """:data:`DEFAULT_BATCH_SIZES` up to ``max_batch``, with ``max_batch`` itself as the top rung. Raises ValueError
    for ``max_batch < 1``."""
    return ladder(DEFAULT_BATCH_SIZES, max_batch)


@dataclass(frozen=True)
class _Graph:
    batch_size: int
    graph: torch.cuda.CUDAGraph
    backend: FlashInferAttentionBackend
    inputs: torch.Tensor  # int32 [3, B] on the device: token ids, M-RoPE positions, KV positions
    logits: torch.Tensor  # float32 [B, vocab] on the device, written by each replay


@dataclass(frozen=True)
class _Planned:
    """A graph planned for a layout: the sequences' ``(num_cached, block_table)`` in order. A table is the same by
    identity, or where the pages the step reads are (a table grown since by ``DecodeGrow`` pages past them)."""

    graph: _Graph
    metadata: AttentionMetadata
    layout: tuple[tuple[int, object], ...]
    page_size: int

    def fits(self, seqs: Sequence[DecodeSeq]) -> bool:
        return len(seqs) == len(self.layout) and all(
            s.num_cached == cached and (s.block_table is table or self._same_pages(s.block_table, table, cached))
            for s, (cached, table) in zip(seqs, self.layout))

    def _same_pages(self, table, planned, cached: int) -> bool:
        read = cached // self.page_size + 1  # the pages of tokens 0 .. cached
        return len(table) >= read and np.array_equal(np.asarray(table[:read]), np.asarray(planned[:read]))


class DecodeGraphs(CapturedGraphs):
    """Captured decode steps of ``runner`` for each size in ``batch_sizes``.

    Raises ValueError when the runner's backend is not flashinfer or ``batch_sizes`` is empty
    (``graph_capture.CapturedGraphs``).
    """

    def __init__(self, runner: ModelRunner, batch_sizes: Sequence[int]) -> None:
        super().__init__(runner, batch_sizes)
        self.scratch = scratch_page(runner.kv_cache.shape[2])
        self.max_batch = self.max_rows
        self._staging = PinnedStaging(3 * self.max_batch, torch.int32, runner.device)
        # Every sequence may hold pages; together they cannot hold more than the pool (plus padding rows).
        self._max_pages = runner.kv_cache.shape[2] + self.max_batch
        self._layout = LayoutStaging(self.max_batch, self._max_pages, runner.device)
        self._prepared: _Planned | None = None
        self._graphs = {b: self._capture(b) for b in reversed(self.rungs)}

    def _capture(self, batch_size: int) -> _Graph:
        runner = self.runner
        inputs = torch.zeros(3, batch_size, dtype=torch.int32, device=runner.device)  # padding: scratch page, slot 0
        backend = FlashInferAttentionBackend.for_cuda_graph(runner.backend, batch_size, self._max_pages, inputs[2])
        metadata = self._metadata([], batch_size)
        backend.plan(metadata)
        graph, logits = self.capture(lambda: runner.decode_logits(inputs[0], inputs[1], backend, metadata))
        return _Graph(batch_size, graph, backend, inputs, logits)

    def _metadata(self, seqs: Sequence[DecodeSeq], batch_size: int) -> AttentionMetadata:
        """Host-side layout of ``seqs`` padded to ``batch_size`` rows of one token in the scratch page."""
        pad = batch_size - len(seqs)
        return AttentionMetadata.build(
            [1] * batch_size, [s.num_cached for s in seqs] + [0] * pad,
            [s.block_table for s in seqs] + [[self.scratch]] * pad, self.runner.page_size, "cpu")

    def _plan(self, seqs: Sequence[DecodeSeq]) -> _Planned:
        """Plan the smallest graph that holds ``seqs``; the copies are queued on the current stream and the
        host does not wait for the GPU. Raises ValueError for more than ``max_batch`` sequences."""
        g = self._graphs[rung_for(self.rungs, len(seqs))]
        metadata = self._metadata(seqs, g.batch_size)
        self._layout.plan(g.backend, metadata)
        return _Planned(g, metadata, tuple((s.num_cached, s.block_table) for s in seqs), self.runner.page_size)

    def prepare(self, seqs: Sequence[DecodeSeq]) -> None:
        """Plan the next step for ``seqs`` now (their token ids are not read); the next :meth:`stage` uses
        this plan if its sequences have the same ``num_cached`` and block tables (``_Planned.fits``: by identity, or
        by the pages the step reads; a table must not be changed in place), else plans again. Raises ValueError as
        :meth:`stage` does."""
        self._prepared = self._plan(seqs)

    def stage(self, seqs: Sequence[DecodeSeq], token_ids: torch.Tensor | None = None) -> _Graph:
        """The host part of a step: plan the smallest graph that holds ``seqs`` (unless :meth:`prepare` did)
        and copy its inputs in (queued on the current stream, ahead of the replay). ``token_ids``: int64 ``[n]``
        on the device (the last step's samples, not yet read by the host; ``ModelRunner.decode`` checks their
        length), used instead of ``seqs``' token ids and copied on the device. Raises ValueError for more than
        ``max_batch`` sequences."""
        n = len(seqs)
        prepared, self._prepared = self._prepared, None
        planned = prepared if prepared is not None and prepared.fits(seqs) else self._plan(seqs)
        g = planned.graph
        staging = self._staging.take(3, g.batch_size)
        staging[0] = 0
        if token_ids is None:
            staging[0, :n] = torch.tensor([s.token_id for s in seqs])
        staging[1, :n] = torch.tensor([s.position for s in seqs])
        staging[1, n:] = 0
        staging[2] = planned.metadata.kv_positions
        g.inputs.copy_(staging, non_blocking=True)
        self._staging.sent()
        if token_ids is not None:
            g.inputs[0, :n].copy_(token_ids)
        return g

    def run(self, seqs: Sequence[DecodeSeq], token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`stage`, then replay; float32 logits ``[len(seqs), vocab]``, a view of the graph's output
        buffer valid until the next replay of that size. Raises ValueError as :meth:`stage` does."""
        g = self.stage(seqs, token_ids)
        g.graph.replay()
        return g.logits[:len(seqs)]
