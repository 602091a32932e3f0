"""flashinfer paged attention: ragged prefill chunks appended to cached KV, and batched decode.

One ``plan()`` per step picks the kernel family: a step whose sequences each bring one token runs
flashinfer's ``BatchDecodeWithPagedKVCacheWrapper`` with ``use_tensor_cores=True`` (the CUDA-core decode
kernels reject Qwen2.5-VL-7B's GQA group of 7: "Unsupported group_size: 7"); any other step runs
``BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True``, whose mask is aligned to the end of each
sequence's KV, so chunk token ``j`` sees the cached prefix and chunk tokens ``0 .. j``. Keys and values are
written before the kernel reads the pages, by flashinfer's ``append_paged_kv_cache``: keys and values of a
layer in one kernel, in about a third of the time of two indexing kernels (bench/RESULTS.md, "KV writes").
flashinfer has no float32 kernels: float16 and bfloat16 only, head_dim 64, 128 or 256.

Prefill steps pick flashinfer's kernel (its ``backend`` argument) by :func:`prefill_kernel`: FA2, which splits a
long KV over several CTAs, where FA3's work items would leave SMs idle, else ``"auto"`` (FA3 on Hopper). A step
whose kernels may use fewer SMs than the device has (``sms_limit``: encode_prefill's green context) runs FA3 as one
call per group of query rows (``sm_partition.row_groups``): flashinfer deals FA3's work to one CTA per SM of the
device, which on fewer SMs runs in two rounds (a 2,048-row chunk over 100,000 cached tokens on 120 of the H200's 132
SMs: 9.3 ms in one call, 5.6 in four; 5.6 on the whole GPU: bench/results/green-context-probe-h200-2026-12-04/).

For CUDA graphs, :meth:`FlashInferAttentionBackend.for_cuda_graph` builds a decode-only backend and
:meth:`FlashInferAttentionBackend.for_prefill_graph` a backend for one sequence's prefill chunk, whose index buffers
have fixed addresses (flashinfer's ``use_cuda_graph`` mode); ``plan()`` then copies a new layout into them, and a
captured graph replays with it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from backends.runtime.attention.base import AttentionBackend, AttentionMetadata
from backends.runtime.attention.sm_partition import group_layout, group_rows, row_groups, tile_rows

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
WORKSPACE_BYTES = 256 << 20  # flashinfer's split-KV scratch; its docs recommend 128 MB or more
PREFILL_KERNELS = ("fa2", "auto")  # flashinfer's BatchPrefillWithPagedKVCacheWrapper(backend=...) values we use
# FA3 row groups a step may be cut into (sm_partition); a step that would need more runs in one call. Each group past
# the first holds a wrapper of its own, made on first need: 8 MiB of device and 8 MiB of pinned host memory.
MAX_ROW_GROUPS = 8


def flashinfer_supports(head_dim: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """``None`` when flashinfer can run this model here, else the reason it cannot (a sentence)."""
    if device.type != "cuda":
        return f"flashinfer needs a CUDA device, got {device}"
    if dtype not in SUPPORTED_DTYPES:
        return f"flashinfer has no {dtype} kernels (float16, bfloat16 only)"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"flashinfer kernels are built for head_dim {SUPPORTED_HEAD_DIMS}, the model has {head_dim}"
    try:
        import flashinfer  # noqa: F401
    except ImportError as exc:
        return f"flashinfer is not installed ({exc})"
    return None


def prefill_kernel(qo_lens: Sequence[int], num_qo_heads: int, head_dim: int, num_sms: int) -> str:
    """flashinfer's prefill ``backend`` for a step whose sequences bring ``qo_lens`` new tokens each: ``"fa2"`` when
    FA3 would make fewer work items than the GPU has SMs (``num_sms``), else ``"auto"`` (FA3 on Hopper, FA2
    elsewhere).

    Source: flashinfer 0.6's ``PrefillSM90Plan`` (include/flashinfer/attention/scheduler.cuh), FA3's plan on Hopper,
    makes one work item per query head and query tile of 128 rows (192 for head_dim 64), query heads not packed by
    GQA group, and never splits the KV: each item reads its sequence's whole KV on one SM, so a short chunk over a
    long cached context runs on ``num_qo_heads * tiles`` SMs (28 of 132 for a chunk of up to 128 tokens of
    Qwen2.5-VL-7B). FA2's plan (``PrefillSplitQOKVIndptr``) splits the KV into chunks until the CTAs fill the GPU.
    """
    tile = tile_rows(head_dim)
    items = num_qo_heads * sum(-(-n // tile) for n in qo_lens)
    return "fa2" if items < num_sms else "auto"


@dataclass(frozen=True)
class _AppendIndices:
    """Where a step's new keys and values go, as ``flashinfer.append_paged_kv_cache`` takes it: int32 tensors
    on the pool's device (``AttentionMetadata``'s fields of the same names)."""

    batch_indices: torch.Tensor  # [T]
    kv_positions: torch.Tensor  # [T]
    kv_indices: torch.Tensor  # [pages]
    kv_indptr: torch.Tensor  # [b + 1]
    kv_last_page_len: torch.Tensor  # [b]

    @classmethod
    def upload(cls, metadata: AttentionMetadata, device: torch.device) -> "_AppendIndices":
        """The metadata's host arrays on ``device``, in one copy."""
        parts = (metadata.batch_indices, metadata.kv_positions, metadata.kv_indices, metadata.kv_indptr,
                 metadata.kv_last_page_len)
        return cls(*torch.cat(parts).to(device, non_blocking=True).split([p.numel() for p in parts]))


class _RowGroups:
    """FA3 over a step's query rows cut into groups (``sm_partition.row_groups``): ``(rows, wrapper)`` per group, each
    wrapper planned for its rows; :meth:`run` is a wrapper's ``run`` over all of them."""

    def __init__(self, groups: list[tuple[slice, object]]) -> None:
        self.groups = groups

    def run(self, q: torch.Tensor, paged: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        out = torch.empty_like(q)
        for rows, wrapper in self.groups:
            wrapper.run(q[rows], paged, out=out[rows])
        return out


class FlashInferAttentionBackend(AttentionBackend):
    """Paged attention with flashinfer kernels on one CUDA device.

    ``num_qo_heads``/``num_kv_heads``/``head_dim``: the language model's attention shape; ``page_size``:
    tokens per KV page; ``dtype``: the pool's and activations' dtype. Raises ValueError where
    :func:`flashinfer_supports` says no. The keyword arguments are for the graph backends' constructors.
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype: torch.dtype, device: torch.device, *, workspace: torch.Tensor | None = None,
                 decode_wrapper=None, prefill_wrappers: dict | None = None,
                 static_append: _AppendIndices | None = None) -> None:
        reason = flashinfer_supports(head_dim, dtype, device)
        if reason:
            raise ValueError(reason)
        import flashinfer

        self.shape = (num_qo_heads, num_kv_heads, head_dim, page_size)
        self.dtype = dtype
        properties = torch.cuda.get_device_properties(device)
        self.num_sms = properties.multi_processor_count  # under MPS: the share's
        self.fa3 = properties.major == 9  # flashinfer's "auto" prefill kernel is FA3 on Hopper (sm90) only
        self.workspace = workspace if workspace is not None else torch.empty(
            WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        if decode_wrapper is None and prefill_wrappers is None:  # eager: every kind of step, same workspace
            decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                           use_tensor_cores=True)
            prefill_wrappers = {kernel: flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "NHD", backend=kernel) for kernel in PREFILL_KERNELS}
        self._decode = decode_wrapper
        self._prefill = prefill_wrappers or {}  # by kernel; a prefill graph's backend holds the one it captured
        self._row_group_wrappers: list = []  # FA3 wrappers of row groups 1.. (group 0 uses self._prefill["auto"])
        self._append_kv = flashinfer.append_paged_kv_cache
        self._active = None
        self._static_append = static_append
        self._append: _AppendIndices | None = None

    def prefill_kernel(self, qo_lens: Sequence[int]) -> str:
        """:func:`prefill_kernel` for this backend's heads and GPU."""
        return prefill_kernel(qo_lens, self.shape[0], self.shape[2], self.num_sms)

    @classmethod
    def for_cuda_graph(cls, like: "FlashInferAttentionBackend", batch_size: int, max_pages: int,
                       kv_positions: torch.Tensor) -> "FlashInferAttentionBackend":
        """A decode-only backend for graphs of exactly ``batch_size`` sequences holding at most ``max_pages``
        KV pages together; shares ``like``'s workspace (graphs replay one at a time). Its KV writes always
        read ``kv_positions`` (int32 ``[batch_size]`` on the device, the graph's input buffer: each row's
        index in its sequence) and the page layout that ``plan()`` copies into the wrapper's fixed buffers."""
        import flashinfer

        device = like.workspace.device
        append = _AppendIndices(
            batch_indices=torch.arange(batch_size, dtype=torch.int32, device=device), kv_positions=kv_positions,
            kv_indices=torch.zeros(max_pages, dtype=torch.int32, device=device),
            kv_indptr=torch.zeros(batch_size + 1, dtype=torch.int32, device=device),
            kv_last_page_len=torch.ones(batch_size, dtype=torch.int32, device=device))
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            like.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
            paged_kv_indptr_buffer=append.kv_indptr, paged_kv_indices_buffer=append.kv_indices,
            paged_kv_last_page_len_buffer=append.kv_last_page_len)
        return cls(*like.shape, like.dtype, device, workspace=like.workspace, decode_wrapper=wrapper,
                   static_append=append)

    @classmethod
    def for_prefill_graph(cls, like: "FlashInferAttentionBackend", rows: int, pages: torch.Tensor,
                          kv_positions: torch.Tensor) -> "FlashInferAttentionBackend":
        """A prefill backend for graphs of ``rows`` query rows of one sequence; shares ``like``'s workspace, its
        kernel is ``like.prefill_kernel([rows])``.

        ``pages``: int32 ``[1 + max_pages]`` on the device, the scratch page first: ``plan()`` copies the
        sequence's page list into ``pages[1:]`` (the wrapper's fixed indices buffer). The KV writes see ``pages``
        whole as one sequence and write row ``i`` at its position ``kv_positions[i]`` (int32 ``[rows]`` on the
        device, the graph's input buffer): ``page_size + c + j`` for the chunk's token ``j`` over ``c`` cached
        tokens, ``0`` (the scratch page's slot 0) for padding rows.

        The first ``plan()`` must describe all ``rows`` query rows: flashinfer sizes the graph's tiles and work lists
        for it, and later plans may hold fewer rows (its ``use_cuda_graph`` mode allows up to the first plan's),
        the rest of ``q`` unread and their output rows zero.
        """
        import flashinfer

        device = like.workspace.device
        num_pages, page_size = pages.numel(), like.shape[3]
        append = _AppendIndices(
            batch_indices=torch.zeros(rows, dtype=torch.int32, device=device), kv_positions=kv_positions,
            kv_indices=pages, kv_indptr=torch.tensor([0, num_pages], dtype=torch.int32, device=device),
            kv_last_page_len=torch.tensor([page_size], dtype=torch.int32, device=device))
        kernel = like.prefill_kernel([rows])
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            like.workspace, "NHD", use_cuda_graph=True, backend=kernel,
            qo_indptr_buf=torch.zeros(2, dtype=torch.int32, device=device),
            paged_kv_indptr_buf=torch.zeros(2, dtype=torch.int32, device=device),
            paged_kv_indices_buf=pages[1:],
            paged_kv_last_page_len_buf=torch.ones(1, dtype=torch.int32, device=device))
        return cls(*like.shape, like.dtype, device, workspace=like.workspace, prefill_wrappers={kernel: wrapper},
                   static_append=append)

    def plan(self, metadata: AttentionMetadata) -> None:
        num_qo_heads, num_kv_heads, head_dim, page_size = self.shape
        if page_size != metadata.page_size:
            raise ValueError(f"metadata page_size {metadata.page_size} != backend page_size {page_size}")
        common = dict(q_data_type=self.dtype, kv_data_type=self.dtype)
        if metadata.is_decode and self._decode is not None:
            self._decode.plan(metadata.kv_indptr, metadata.kv_indices, metadata.kv_last_page_len,
                              num_qo_heads, num_kv_heads, head_dim, page_size, **common)
            self._active = self._decode
        elif not self._prefill:
            raise ValueError("a decode-graph backend runs decode steps only (one token per sequence)")
        else:
            self._active = self._plan_prefill(metadata, common)
        self._append = self._static_append or _AppendIndices.upload(metadata, self.workspace.device)

    def _plan_prefill(self, metadata: AttentionMetadata, common: dict):
        """A prefill step's kernel, planned: a graph's backend the one it was captured with; else FA2 or FA3
        (:func:`prefill_kernel`, for ``sms_limit`` SMs), FA3 as one wrapper per group of query rows (more wrappers
        made as a step first needs them) where the step may use fewer SMs than the device has, at least as many as
        the model has query heads, and its work items exceed them in at most ``MAX_ROW_GROUPS`` groups."""
        import flashinfer

        num_qo_heads, num_kv_heads, head_dim, page_size = self.shape
        qo_lens = np.diff(metadata.cu_seqlens_q.numpy()).tolist()
        sms = min(self.sms_limit or self.num_sms, self.num_sms)
        if len(self._prefill) == 1:  # a graph's backend: the kernel it was captured with, all rows in one call
            (kernel,), groups = self._prefill, []
        else:
            kernel = prefill_kernel(qo_lens, num_qo_heads, head_dim, sms)
            # each group holds every head's items of a tile at least: with fewer SMs than heads, one call does better
            fewer = self.fa3 and kernel == "auto" and num_qo_heads <= sms < self.num_sms
            groups = row_groups(qo_lens, num_qo_heads, head_dim, sms) if fewer else []
        if not 1 < len(groups) <= MAX_ROW_GROUPS:
            wrapper = self._prefill[kernel]
            wrapper.plan(metadata.cu_seqlens_q, metadata.kv_indptr, metadata.kv_indices, metadata.kv_last_page_len,
                         num_qo_heads, num_kv_heads, head_dim, page_size, causal=True, **common)
            return wrapper
        while len(self._row_group_wrappers) < len(groups) - 1:
            self._row_group_wrappers.append(flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "NHD", backend="auto"))
        starts = metadata.cu_seqlens_q.numpy()
        layout = (metadata.kv_indptr.numpy(), metadata.kv_indices.numpy(), metadata.kv_last_page_len.numpy())
        planned = []
        for pieces, wrapper in zip(groups, [self._prefill["auto"], *self._row_group_wrappers]):
            qo, indptr, indices, last = (torch.from_numpy(a) for a in group_layout(pieces, qo_lens, *layout,
                                                                                    page_size))
            wrapper.plan(qo, indptr, indices, last, num_qo_heads, num_kv_heads, head_dim, page_size, causal=True,
                         **common)
            planned.append((group_rows(pieces, starts), wrapper))
        return _RowGroups(planned)

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor) -> torch.Tensor:
        if self._active is None or self._append is None:
            raise RuntimeError("FlashInferAttentionBackend.forward called before plan()")
        a = self._append
        paged = (kv_cache[layer_idx, 0], kv_cache[layer_idx, 1])
        self._append_kv(k, v, a.batch_indices, a.kv_positions, paged, a.kv_indices, a.kv_indptr, a.kv_last_page_len,
                        "NHD")
        return self._active.run(q.contiguous(), paged)
