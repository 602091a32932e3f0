"""CUDA graphs for short prefill chunks of one sequence (a text request's prompt, a follow-up question).

A prefill chunk of a few hundred tokens is bound by the host launching its kernels, as a decode step is, whatever
its size (bench/RESULTS.md, "prefill, short chunks"). So a chunk of ``n <= 512`` tokens of ONE sequence replays the
graph of the smallest rung of :data:`PREFILL_RUNGS` tokens that holds it (``graph_capture``: capture, memory pool,
rungs). What goes in and out:

* in: the chunk's embeddings (text rows and any visual rows: they are made before the graph, by
  ``PromptState.chunk``, so a chunk with visual embeddings runs graphed as well) copied into the graph's embedding
  buffer, its rotary positions (M-RoPE's three rows or 1-D RoPE's one) and KV write positions through one pinned
  buffer and one asynchronous copy, and its paged layout planned into flashinfer's fixed buffers;
* padding rows ``n .. R-1``: their keys and values go to the scratch page's slot 0 (``kv_cache.scratch_page``, the
  page decode graphs' padding rows use), their outputs are ignored;
* out: the final norm's hidden states ``[R, hidden]``; the LM head runs outside the graph on the last real row only.

flashinfer's layout for the attention is the real rows only: ``qo_indptr = [0, n]`` over the sequence's ``c + n``
KV tokens. Its ``use_cuda_graph`` mode sizes a graph's grid and buffers for the rows of the wrapper's first
``plan()`` (``R``, at capture) and takes fewer rows later: ``plan()`` refuses only more ("cannot exceed the number of
rows set during initialization"); in flashinfer 0.6's scheduler.cuh, FA2's ``PrefillSplitQOKVIndptr`` assumes "the
dummy data based on which the CUDA graph is created fixes the maximum number of tokens" and its kernels read the real
row count from the device, and FA3's ``PrefillSM90Plan`` makes work items for the real rows only. The other query
rows are left unread and their output rows zero (``run()`` zero-fills its output). Declaring the padding rows as query
rows instead would need keys for them: KV slots past the chunk in the sequence's own pages (which its block table
need not have, and which the next chunk overwrites) or a second sequence of up to 511 tokens over the scratch page;
``qo_indptr`` of the real rows needs neither. The KV writes (``append_paged_kv_cache``) take any page list: they see
the scratch page followed by the sequence's pages as one sequence (:func:`append_positions`).

Chunks of several sequences, or of more than :data:`PREFILL_RUNGS`' top tokens, run eagerly (``ModelRunner.prefill``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from backends.runtime.attention.base import AttentionMetadata
from backends.runtime.attention.flashinfer_backend import FlashInferAttentionBackend
from backends.runtime.language_model.graph_capture import CapturedGraphs, LayoutStaging, PinnedStaging, rung_for
from backends.runtime.language_model.kv_cache import pages_needed, scratch_page

if TYPE_CHECKING:
    from backends.runtime.model_runner import ModelRunner, PrefillChunk

PREFILL_RUNGS = (16, 32, 64, 128, 256, 512)  # tokens per graph


def append_positions(kv_positions: torch.Tensor, rows: int, page_size: int) -> torch.Tensor:
    """Where a graph of ``rows`` rows writes each row's keys and values, for a chunk whose ``n`` tokens have KV
    indices ``kv_positions`` (int32 ``[n]``, ``c .. c + n - 1``): positions in the page list "scratch page, then the
    sequence's pages", so the chunk's token ``j`` at ``page_size + c + j`` and padding rows at 0 (the scratch page's
    slot 0). Returns int32 ``[rows]`` on ``kv_positions``' device. Raises ValueError for ``n > rows``."""
    n = kv_positions.numel()
    if n > rows:
        raise ValueError(f"{n} tokens do not fit a graph of {rows} rows")
    out = torch.zeros(rows, dtype=torch.int32, device=kv_positions.device)
    out[:n] = kv_positions + page_size
    return out


def capture_layout(rows: int, scratch: int, page_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
    """The layout a graph of ``rows`` rows is captured with: all rows as one sequence's first tokens over KV pages
    that are all the scratch page (flashinfer sizes the graph for the rows of its first plan; the warm-up and capture
    runs then read and write nothing but the scratch page); also the compile's warm-up forward
    (``compile.warm_up_compiled``). ``AttentionMetadata.build`` with ``device`` (its slot mapping's)."""
    return AttentionMetadata.build([rows], [0], [[scratch] * pages_needed(rows, page_size)], page_size, device)


@dataclass(frozen=True)
class _Graph:
    rows: int
    graph: torch.cuda.CUDAGraph
    backend: FlashInferAttentionBackend
    embeds: torch.Tensor  # [rows, hidden] model dtype on the device: the chunk's embeddings, then stale rows
    inputs: torch.Tensor  # int32 [position_rows + 1, rows] on the device: rotary positions, then append positions
    hidden: torch.Tensor  # [rows, hidden] model dtype on the device: the final norm's output, written by each replay


class PrefillGraphs(CapturedGraphs):
    """Captured prefill chunks of one sequence of ``runner`` for each token count in ``rungs``.

    Raises ValueError when the runner's backend is not flashinfer or ``rungs`` is empty
    (``graph_capture.CapturedGraphs``).
    """

    def __init__(self, runner: ModelRunner, rungs: Sequence[int] = PREFILL_RUNGS) -> None:
        super().__init__(runner, rungs)
        self.scratch = scratch_page(runner.kv_cache.shape[2])
        device = runner.device
        # A sequence holds at most the pool's pages; the capture layout holds the top rung's
        max_pages = max(runner.kv_cache.shape[2], pages_needed(self.max_rows, runner.page_size))
        # The KV writes' page list: the scratch page, then the sequence's pages, which each plan copies into
        # pages[1:] (flashinfer's fixed indices buffer, shared by all rungs: one graph is planned and replayed at once).
        self._pages = torch.full((1 + max_pages,), self.scratch, dtype=torch.int32, device=device)
        self._layout = LayoutStaging(1, max_pages, device)
        self._staging = PinnedStaging((runner.family.position_rows + 1) * self.max_rows, torch.int32, device)
        self._graphs = {r: self._capture(r) for r in reversed(self.rungs)}

    def _capture(self, rows: int) -> _Graph:
        runner = self.runner
        hidden_size = runner.model.config.get_text_config().hidden_size
        embeds = torch.zeros(rows, hidden_size, dtype=runner.dtype, device=runner.device)
        inputs = torch.zeros(runner.family.position_rows + 1, rows, dtype=torch.int32, device=runner.device)
        backend = FlashInferAttentionBackend.for_prefill_graph(runner.backend, rows, self._pages, inputs[-1])
        metadata = capture_layout(rows, self.scratch, runner.page_size)
        self._layout.plan(backend, metadata)
        graph, hidden = self.capture(lambda: runner.run_layers(embeds, inputs[:-1], backend, metadata))
        return _Graph(rows, graph, backend, embeds, inputs, hidden)

    def run(self, chunk: PrefillChunk) -> torch.Tensor:
        """Prefill ``chunk`` (its ``n`` embedding rows, positions ``[position_rows, n]`` on any device) by the graph
        of the smallest rung that holds it, writing its KV; returns float32 logits ``[1, vocab]`` of its last token
        with ``want_logits``, else ``[0, vocab]``. Queued on the current stream; the host does not wait for the GPU
        (a position on the GPU is copied through the host). Raises ValueError for more than ``max_rows`` tokens or a
        block table too short for them."""
        runner = self.runner
        n = chunk.embeds.shape[0]
        g = self._graphs[rung_for(self.rungs, n)]
        metadata = AttentionMetadata.build([n], [chunk.num_cached], [chunk.block_table], runner.page_size, "cpu")
        self._layout.plan(g.backend, metadata)
        staging = self._staging.take(runner.family.position_rows + 1, g.rows)
        staging[:-1, :n] = chunk.positions
        staging[:-1, n:] = 0
        staging[-1] = append_positions(metadata.kv_positions, g.rows, runner.page_size)
        g.inputs.copy_(staging, non_blocking=True)
        self._staging.sent()
        g.embeds[:n].copy_(chunk.embeds)
        g.graph.replay()
        last = g.hidden[n - 1:n] if chunk.want_logits else g.hidden[:0]
        return runner.model.lm_head(last).float()
