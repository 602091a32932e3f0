"""flashinfer paged attention: ragged prefill chunks appended to cached KV, and batched decode.

One ``plan()`` per step picks the kernel family: a step whose sequences each bring one token runs
flashinfer's ``BatchDecodeWithPagedKVCacheWrapper`` with ``use_tensor_cores=True`` (the CUDA-core decode
kernels reject Qwen2.5-VL-7B's GQA group of 7: "Unsupported group_size: 7"); any other step runs
``BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True``, whose mask is aligned to the end of each
sequence's KV, so chunk token ``j`` sees the cached prefix and chunk tokens ``0 .. j``. Keys and values are
written before the kernel reads the pages, by flashinfer's ``append_paged_kv_cache``: keys and values of a
layer in one kernel, in about a third of the time of two indexing kernels (bench/RESULTS.md, "KV writes").
flashinfer has no float32 kernels: float16 and bfloat16 only, head_dim 64, 128 or 256.

For CUDA graphs, :meth:`FlashInferAttentionBackend.for_cuda_graph` builds a decode-only backend whose
index buffers have fixed addresses (flashinfer's ``use_cuda_graph`` mode); ``plan()`` then copies a new
layout into them, and a captured graph replays with it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.runtime.attention.base import AttentionBackend, AttentionMetadata

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
WORKSPACE_BYTES = 256 << 20  # flashinfer's split-KV scratch; its docs recommend 128 MB or more


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


class FlashInferAttentionBackend(AttentionBackend):
    """Paged attention with flashinfer kernels on one CUDA device.

    ``num_qo_heads``/``num_kv_heads``/``head_dim``: the language model's attention shape; ``page_size``:
    tokens per KV page; ``dtype``: the pool's and activations' dtype. Raises ValueError where
    :func:`flashinfer_supports` says no.
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype: torch.dtype, device: torch.device, *, workspace: torch.Tensor | None = None,
                 decode_wrapper=None, static_append: _AppendIndices | None = None) -> None:
        reason = flashinfer_supports(head_dim, dtype, device)
        if reason:
            raise ValueError(reason)
        import flashinfer

        self.shape = (num_qo_heads, num_kv_heads, head_dim, page_size)
        self.dtype = dtype
        self.workspace = workspace if workspace is not None else torch.empty(
            WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._decode = decode_wrapper or flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=True)
        # A graph backend decodes only; eager backends also prefill (same workspace: steps never overlap).
        self._prefill = None if decode_wrapper is not None else flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD")
        self._append_kv = flashinfer.append_paged_kv_cache
        self._active = None
        self._static_append = static_append
        self._append: _AppendIndices | None = None

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

    def plan(self, metadata: AttentionMetadata) -> None:
        num_qo_heads, num_kv_heads, head_dim, page_size = self.shape
        if page_size != metadata.page_size:
            raise ValueError(f"metadata page_size {metadata.page_size} != backend page_size {page_size}")
        common = dict(q_data_type=self.dtype, kv_data_type=self.dtype)
        if metadata.is_decode:
            self._decode.plan(metadata.kv_indptr, metadata.kv_indices, metadata.kv_last_page_len,
                              num_qo_heads, num_kv_heads, head_dim, page_size, **common)
            self._active = self._decode
        elif self._prefill is None:
            raise ValueError("a CUDA-graph backend runs decode steps only (one token per sequence)")
        else:
            self._prefill.plan(metadata.cu_seqlens_q, metadata.kv_indptr, metadata.kv_indices,
                               metadata.kv_last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                               causal=True, **common)
            self._active = self._prefill
        self._append = self._static_append or _AppendIndices.upload(metadata, self.workspace.device)

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor) -> torch.Tensor:
        if self._active is None or self._append is None:
            raise RuntimeError("FlashInferAttentionBackend.forward called before plan()")
        a = self._append
        paged = (kv_cache[layer_idx, 0], kv_cache[layer_idx, 1])
        self._append_kv(k, v, a.batch_indices, a.kv_positions, paged, a.kv_indices, a.kv_indptr, a.kv_last_page_len,
                        "NHD")
        return self._active.run(q.contiguous(), paged)
