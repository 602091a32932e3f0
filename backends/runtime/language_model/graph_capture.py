"""What the CUDA graphs of decode steps (``cuda_graphs``) and of short prefill chunks (``prefill_graphs``) share.

A step launches hundreds of small kernels; replaying them as one captured graph removes the launch cost (the practice
of vLLM and SGLang). A graph replays fixed kernels on fixed addresses, so there is one graph per rung of a ladder of
sizes (rows: sequences for decode, tokens for prefill), and a step of ``n`` rows replays the smallest rung of
``R >= n`` rows with ``R - n`` padding rows, which write their keys and values only into the pool's reserved scratch
page (``kv_cache.scratch_page``) and whose outputs are ignored. The attention's layout lives in flashinfer's fixed
index buffers (its ``use_cuda_graph`` mode), which ``plan()`` rewrites before each replay.

Shared here: the rung choice (:func:`ladder`, :func:`rung_for`), capture (:meth:`CapturedGraphs.capture`:
warm-up on a side stream, then capture into one memory pool for all rungs, captured largest first as torch
recommends; :func:`capture_graph`, which the vision tower's graphs use too), and the pinned buffers through which a
step's host arrays reach the device without a host sync (:class:`PinnedStaging`, :class:`LayoutStaging`).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Sequence, TypeVar

import torch

from backends.runtime.attention.base import AttentionMetadata
from backends.runtime.attention.flashinfer_backend import FlashInferAttentionBackend

if TYPE_CHECKING:
    from backends.runtime.model_runner import ModelRunner

T = TypeVar("T")


def ladder(sizes: Sequence[int], top: int) -> tuple[int, ...]:
    """The rungs of ``sizes`` below ``top``, and ``top`` itself as the top rung, ascending. Raises ValueError for
    ``top < 1``."""
    if top < 1:
        raise ValueError(f"the top rung must be at least 1, got {top}")
    return tuple(sorted({s for s in sizes if s < top} | {top}))


def rung_for(rungs: Sequence[int], n: int) -> int:
    """The smallest of ``rungs`` that holds ``n`` rows. Raises ValueError for ``n`` outside ``1 .. max(rungs)``."""
    if not 0 < n <= max(rungs):
        raise ValueError(f"{n} rows; the graphs hold 1 .. {max(rungs)}")
    return min(r for r in rungs if r >= n)


class PinnedStaging:
    """A pinned host buffer of ``numel`` elements of ``dtype`` whose contents reach ``device`` by asynchronous copies
    queued on the current stream. :meth:`take` waits until the copies queued before the last :meth:`sent` have run
    (normally long done: the caller has read a step's results since), so the host never rewrites memory a copy still
    reads."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.buffer = torch.zeros(numel, dtype=dtype, pin_memory=True)
        self.device = device
        self._copied = torch.cuda.Event()

    def take(self, *shape: int) -> torch.Tensor:
        """The buffer's first elements as a contiguous tensor of ``shape`` (pinned: a copy out of it is asynchronous),
        once free to rewrite. Raises RuntimeError when ``shape`` holds more than ``numel`` elements."""
        self._copied.synchronize()
        return self.buffer[:math.prod(shape)].view(shape)

    def sent(self) -> None:
        """Mark the copies out of the buffer queued so far (on the current stream of ``device``)."""
        self._copied.record(torch.cuda.current_stream(self.device))


class LayoutStaging:
    """Plans a graph's backend for a step's layout of at most ``max_seqs`` sequences holding ``max_pages`` KV pages.

    flashinfer's ``plan()`` copies the layout into the graph's fixed buffers: asynchronously from pinned memory (the
    offsets) and from the device (the page list), where a copy from pageable memory, or of a page list on the host,
    would wait for the GPU to finish the step it runs. So the offsets go through a pinned buffer and the page list
    through it to a device buffer, both copies queued on the current stream.
    """

    def __init__(self, max_seqs: int, max_pages: int, device: torch.device) -> None:
        # qo indptr, kv indptr, last page lengths, pages (pinned); the page list again on the device
        self._host = PinnedStaging(3 * max_seqs + 2 + max_pages, torch.int32, device)
        self._pages = torch.zeros(max_pages, dtype=torch.int32, device=device)

    def plan(self, backend: FlashInferAttentionBackend, metadata: AttentionMetadata) -> None:
        """``backend.plan(metadata)`` through the staging buffers; the host does not wait for the GPU. Raises
        ValueError as the backend's plan does."""
        b, pages = metadata.num_seqs, metadata.kv_indices.numel()
        qo, indptr, last, indices = self._host.take(3 * b + 2 + pages).split([b + 1, b + 1, b, pages])
        qo.copy_(metadata.cu_seqlens_q)
        indptr.copy_(metadata.kv_indptr)
        last.copy_(metadata.kv_last_page_len)
        indices.copy_(metadata.kv_indices)
        on_device = self._pages[:pages]
        on_device.copy_(indices, non_blocking=True)
        try:
            backend.plan(replace(metadata, cu_seqlens_q=qo, kv_indptr=indptr, kv_last_page_len=last,
                                 kv_indices=on_device))
        finally:  # a plan that fails may have queued copies already
            self._host.sent()


class CapturedGraphs:
    """The base of a runner's captured graphs, one per rung of ``rungs`` (rows per graph).

    Raises ValueError when the runner's backend is not flashinfer (the torch backend plans with host syncs and
    data-dependent shapes, which a graph cannot hold) or a rung is below 1.
    """

    def __init__(self, runner: ModelRunner, rungs: Sequence[int]) -> None:
        if not isinstance(runner.backend, FlashInferAttentionBackend):
            raise ValueError("CUDA graphs need the flashinfer attention backend")
        if not rungs or min(rungs) < 1:
            raise ValueError(f"rungs must be positive, got {list(rungs)}")
        self.runner = runner
        self.rungs = tuple(sorted(set(rungs)))
        self.max_rows = self.rungs[-1]
        self._pool = torch.cuda.graph_pool_handle()

    def capture(self, body: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
        """Capture ``body()`` (no host syncs; its backend planned) into a graph in the shared pool
        (:func:`capture_graph`, under ``torch.inference_mode``). Returns the graph and what the captured ``body()``
        returned: its output buffers, rewritten by each replay."""
        return capture_graph(self.runner.device, self._pool, body)


def capture_graph(device: torch.device, pool: tuple, body: Callable[[], T], mode: Callable = torch.inference_mode,
                  runs: int = 2, error_mode: str = "global") -> tuple[torch.cuda.CUDAGraph, T]:
    """Capture ``body()`` (no host syncs) into a graph in the memory pool ``pool`` (``torch.cuda.graph_pool_handle``)
    after ``runs`` runs on a side stream (lazy initialisation and autotuning stay out of the graph), all under the
    context ``mode()`` (a compiled module is captured under the grad mode it was compiled for). ``error_mode``: the
    ``capture_error_mode`` of ``torch.cuda.graph`` ("thread_local" where other threads of the process may use CUDA
    meanwhile). Returns the graph and what the captured ``body()`` returned: its output buffers, rewritten by each
    replay."""
    with mode():
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(runs):
                body()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode=error_mode):
            out = body()
    return graph, out
