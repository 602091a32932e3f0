"""CUDA graphs for decode steps at a ladder of batch sizes (the practice of vLLM and SGLang).

A decode step of a 7B model launches hundreds of small kernels; replaying them as one captured graph
removes the launch cost. One graph per batch size of the ladder; a batch of ``n`` sequences replays the
smallest graph of ``B >= n`` rows, the ``B - n`` padding rows reading and writing only the pool's
reserved scratch page (``kv_cache.scratch_page``). All graphs share one memory pool (captured largest
first, torch's recommendation) and flashinfer's workspace.

Per step, on the host: the paged layout is planned into the graph's fixed index buffers (flashinfer's
``use_cuda_graph`` mode), token ids, M-RoPE positions and KV positions go through one pinned buffer and one
asynchronous copy, then the graph replays. The step's only host sync is the caller's read of the
sampled tokens; token ids may also come from the device (the last step's samples), so that the caller can
launch a step before it reads the last one's tokens (``backends.runtime.sampling.token_readback``).

The plan does not depend on the tokens, so a caller may :meth:`DecodeGraphs.prepare` the next step's layout
while the GPU still runs this one (bench/RESULTS.md, "decode step, host part") and only fill in the token ids
once it has read them. For
that the plan's copies are asynchronous: the layout goes to flashinfer from pinned memory and the page list from
the device (a copy from pageable memory, or of host page indices, would wait for the GPU to finish the running
step). Before it rewrites its pinned buffers, a plan waits for the copies of the plan before it: a caller that
prepares and then stages a different layout without reading the tokens in between waits for the running step.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

import torch

from backends.runtime.attention.base import AttentionMetadata
from backends.runtime.attention.flashinfer_backend import FlashInferAttentionBackend
from backends.runtime.language_model.kv_cache import scratch_page

if TYPE_CHECKING:
    from backends.runtime.model_runner import DecodeSeq, ModelRunner

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def batch_ladder(max_batch: int) -> tuple[int, ...]:
    """:data:`DEFAULT_BATCH_SIZES` up to ``max_batch``, with ``max_batch`` itself as the top rung."""
    return tuple(sorted({b for b in DEFAULT_BATCH_SIZES if b < max_batch} | {max_batch}))


@dataclass(frozen=True)
class _Graph:
    batch_size: int
    graph: torch.cuda.CUDAGraph
    backend: FlashInferAttentionBackend
    inputs: torch.Tensor  # int32 [3, B] on the device: token ids, M-RoPE positions, KV positions
    logits: torch.Tensor  # float32 [B, vocab] on the device, written by each replay


@dataclass(frozen=True)
class _Planned:
    """A graph planned for a layout: the sequences' ``(num_cached, block_table)`` in order, tables by identity."""

    graph: _Graph
    metadata: AttentionMetadata
    layout: tuple[tuple[int, object], ...]

    def fits(self, seqs: Sequence[DecodeSeq]) -> bool:
        return len(seqs) == len(self.layout) and all(
            s.num_cached == cached and s.block_table is table for s, (cached, table) in zip(seqs, self.layout))


class DecodeGraphs:
    """Captured decode steps of ``runner`` for each size in ``batch_sizes``.

    Raises ValueError when the runner's backend is not flashinfer (the torch backend plans with host
    syncs and data-dependent shapes, which a graph cannot hold) or ``batch_sizes`` is empty.
    """

    def __init__(self, runner: ModelRunner, batch_sizes: Sequence[int]) -> None:
        if not isinstance(runner.backend, FlashInferAttentionBackend):
            raise ValueError("CUDA graphs need the flashinfer attention backend")
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"batch_sizes must be positive, got {list(batch_sizes)}")
        self.runner = runner
        self.scratch = scratch_page(runner.kv_cache.shape[2])
        self.max_batch = max(batch_sizes)
        self._staging = torch.zeros(3, self.max_batch, dtype=torch.int32, pin_memory=True)
        self._staged = torch.cuda.Event()  # the last copy out of _staging has finished
        max_pages = runner.kv_cache.shape[2] + self.max_batch
        # a plan's layout: kv_indptr, kv_last_page_len, kv_indices (pinned), the page list again on the device
        self._layout = torch.zeros(2 * self.max_batch + 1 + max_pages, dtype=torch.int32, pin_memory=True)
        self._pages = torch.zeros(max_pages, dtype=torch.int32, device=runner.device)
        self._planned = torch.cuda.Event()  # the last plan's copies out of pinned memory have finished
        self._prepared: _Planned | None = None
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs = {b: self._capture(b) for b in sorted(set(batch_sizes), reverse=True)}
        self._sizes = sorted(self._graphs)

    def _capture(self, batch_size: int) -> _Graph:
        runner = self.runner
        inputs = torch.zeros(3, batch_size, dtype=torch.int32, device=runner.device)  # padding: scratch page, slot 0
        # Every sequence may hold pages; together they cannot hold more than the pool (plus padding rows).
        backend = FlashInferAttentionBackend.for_cuda_graph(
            runner.backend, batch_size, runner.kv_cache.shape[2] + batch_size, inputs[2])
        metadata = self._metadata([], batch_size)
        backend.plan(metadata)
        with torch.inference_mode():
            side = torch.cuda.Stream(runner.device)
            side.wait_stream(torch.cuda.current_stream(runner.device))
            with torch.cuda.stream(side):  # warm-up outside the graph (lazy inits, autotuning)
                for _ in range(2):
                    runner.decode_logits(inputs[0], inputs[1], backend, metadata)
            torch.cuda.current_stream(runner.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = runner.decode_logits(inputs[0], inputs[1], backend, metadata)
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
        n = len(seqs)
        if not 0 < n <= self.max_batch:
            raise ValueError(f"{n} sequences; graphs hold 1 .. {self.max_batch}")
        g = self._graphs[next(b for b in self._sizes if b >= n)]
        metadata = self._metadata(seqs, g.batch_size)
        b, pages = g.batch_size, metadata.kv_indices.numel()
        self._planned.synchronize()  # normally done: the caller read a step's tokens since the last plan
        indptr, last, indices = self._layout[:2 * b + 1 + pages].split([b + 1, b, pages])
        indptr.copy_(metadata.kv_indptr)
        last.copy_(metadata.kv_last_page_len)
        indices.copy_(metadata.kv_indices)
        on_device = self._pages[:pages]
        on_device.copy_(indices, non_blocking=True)
        try:
            g.backend.plan(replace(metadata, kv_indptr=indptr, kv_last_page_len=last, kv_indices=on_device))
        finally:  # a plan that fails may have queued copies already
            self._planned.record(torch.cuda.current_stream(self.runner.device))
        return _Planned(g, metadata, tuple((s.num_cached, s.block_table) for s in seqs))

    def prepare(self, seqs: Sequence[DecodeSeq]) -> None:
        """Plan the next step for ``seqs`` now (their token ids are not read); the next :meth:`stage` uses
        this plan if its sequences have the same ``num_cached`` and block tables (compared by identity: a
        table must not be changed in place), else plans again. Raises ValueError as :meth:`stage` does."""
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
        self._staged.synchronize()  # normally long done: the copy went ahead of the last replay
        staging = self._staging[:, :g.batch_size]
        staging[0] = 0
        if token_ids is None:
            staging[0, :n] = torch.tensor([s.token_id for s in seqs])
        staging[1, :n] = torch.tensor([s.position for s in seqs])
        staging[1, n:] = 0
        staging[2] = planned.metadata.kv_positions
        g.inputs.copy_(staging, non_blocking=True)
        self._staged.record(torch.cuda.current_stream(self.runner.device))
        if token_ids is not None:
            g.inputs[0, :n].copy_(token_ids)
        return g

    def run(self, seqs: Sequence[DecodeSeq], token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`stage`, then replay; float32 logits ``[len(seqs), vocab]``, a view of the graph's output
        buffer valid until the next replay of that size. Raises ValueError as :meth:`stage` does."""
        g = self.stage(seqs, token_ids)
        g.graph.replay()
        return g.logits[:len(seqs)]
