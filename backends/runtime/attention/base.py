"""The attention-backend contract: one ``plan()`` per step, then ``forward()`` per layer over the paged KV pool.

A step is a ragged batch: sequence ``i`` brings ``n_i`` new tokens (a prefill chunk, or 1 for decode) on
top of ``c_i`` tokens already in the KV cache. Queries, keys and values of all new tokens are packed
along one token axis, sequence after sequence. Attention of a new token at sequence index ``c_i + j``
covers the sequence's tokens ``0 .. c_i + j`` (causal within the chunk, full over the cached prefix).
Softmax scale is ``1/sqrt(head_dim)`` (Qwen2.5-VL's, and flashinfer's default ``sm_scale``). Rotary
embeddings are applied before the backend sees q/k (flashinfer's ``pos_encoding_mode="NONE"``).

The index arrays are flashinfer's paged-KV description (``BatchPrefillWithPagedKVCacheWrapper.plan`` and
``BatchDecodeWithPagedKVCacheWrapper.plan``): int32, built on the host, which is where ``plan()`` wants
them; only ``slot_mapping`` lives on the model's device.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's batch layout (``b`` sequences, ``T = sum(n_i)`` new tokens).

    Build it with :meth:`build`; the fields are what the kernels take.
    """

    page_size: int  # tokens per KV page
    cu_seqlens_q: torch.Tensor  # int32 [b + 1], CPU: offsets of each sequence's new tokens (flashinfer qo_indptr)
    num_cached: torch.Tensor  # int32 [b], CPU: c_i, tokens in the cache before this step
    kv_indptr: torch.Tensor  # int32 [b + 1], CPU: offsets into kv_indices per sequence
    kv_indices: torch.Tensor  # int32 [sum of pages], CPU: the pages holding tokens 0 .. c_i + n_i - 1, in order
    kv_last_page_len: torch.Tensor  # int32 [b], CPU: valid tokens in each sequence's last page, 1 .. page_size
    slot_mapping: torch.Tensor  # int64 [T], model device: flat pool slot (page * page_size + offset) per new token
    batch_indices: torch.Tensor  # int32 [T], CPU: the sequence of each new token (flashinfer append's batch_indices)
    kv_positions: torch.Tensor  # int32 [T], CPU: each new token's index in its sequence, c_i + j (append's positions)

    @property
    def num_seqs(self) -> int:
        return self.num_cached.numel()

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.numel()

    @property
    def is_decode(self) -> bool:
        """Every sequence brings exactly one token (the decode kernels apply)."""
        return self.num_tokens == self.num_seqs

    @classmethod
    def build(cls, num_new: Sequence[int], num_cached: Sequence[int], block_tables: Sequence[Sequence[int]],
              page_size: int, device: torch.device | str) -> "AttentionMetadata":
        """Metadata for sequences with ``num_new[i]`` new tokens after ``num_cached[i]`` cached ones.

        ``block_tables[i]``: the sequence's KV pages, a list or an int32 numpy array (the decode worker keeps
        arrays: then the step's page list is one concatenation of views, not a conversion of Python ints:
        bench/RESULTS.md, "decode step, host part"); it may be longer than needed (pages granted
        for later tokens). Token ``j`` of sequence ``i`` (index ``c_i + j``) goes to the flat slot
        ``table[(c_i + j) // page_size] * page_size + (c_i + j) % page_size``. Raises ValueError for empty
        batches, mismatched lengths, ``num_new < 1``, ``num_cached < 0`` or a block table too short for
        ``num_cached + num_new`` tokens.
        """
        if not (len(num_new) == len(num_cached) == len(block_tables)) or not num_new:
            raise ValueError("num_new, num_cached and block_tables must be non-empty and of equal length")
        new, cached = np.asarray(num_new, dtype=np.int64), np.asarray(num_cached, dtype=np.int64)
        if new.min() < 1 or cached.min() < 0:
            raise ValueError(f"need num_new >= 1 and num_cached >= 0, got {list(num_new)}, {list(num_cached)}")
        total = cached + new
        pages = -(-total // page_size)
        needs = pages.tolist()
        for table, need, tokens in zip(block_tables, needs, total.tolist()):
            if len(table) < need:
                raise ValueError(f"block table of {len(table)} pages cannot hold {tokens} tokens of page size "
                                 f"{page_size}")
        kv_indices = np.concatenate([np.asarray(t[:n], dtype=np.int32) for t, n in zip(block_tables, needs)])
        kv_indptr = np.concatenate(([0], np.cumsum(pages)))
        cu = np.concatenate(([0], np.cumsum(new)))
        index = np.arange(cu[-1]) - np.repeat(cu[:-1] - cached, new)  # each new token's index in its sequence
        page = kv_indices[np.repeat(kv_indptr[:-1], new) + index // page_size].astype(np.int64)

        def i32(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int32))

        return cls(
            page_size=page_size,
            cu_seqlens_q=i32(cu),
            num_cached=i32(cached),
            kv_indptr=i32(kv_indptr),
            kv_indices=torch.from_numpy(kv_indices),
            kv_last_page_len=i32(total - (pages - 1) * page_size),
            slot_mapping=torch.from_numpy(page * page_size + index % page_size).to(device),
            batch_indices=i32(np.repeat(np.arange(len(new)), new)),
            kv_positions=i32(index),
        )


class AttentionBackend(ABC):
    """Paged attention for the language model's layers.

    Per step the runner calls :meth:`plan` once, then :meth:`forward` once per layer, in any order of
    layers. Implementations may keep per-step state (index tensors, kernel plans) between the two.
    """

    # SMs the kernels of the steps planned from now on may use (a CUDA green context's count, set by encode_prefill
    # per step: backends/stages/step_streams.py); None: the device's. A backend whose kernels size no work to the SM
    # count ignores it.
    sms_limit: int | None = None

    @abstractmethod
    def plan(self, metadata: AttentionMetadata) -> None:
        """Prepare for a step with this batch layout (host-side work, done once for all layers)."""

    @abstractmethod
    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """Write the new ``k``/``v`` into their slots of ``kv_cache[layer_idx]``, then attend.

        ``q``: ``[T, num_qo_heads, head_dim]``; ``k``, ``v``: ``[T, num_kv_heads, head_dim]``; rotary
        embeddings applied, pool dtype, model device, possibly non-contiguous views. ``kv_cache``: the
        whole pool ``[layers, 2, pages, page_size, num_kv_heads, head_dim]``. ``num_qo_heads`` is a
        multiple of ``num_kv_heads`` (GQA: query head ``h`` reads KV head
        ``h // (num_qo_heads // num_kv_heads)``). Returns ``[T, num_qo_heads, head_dim]`` in ``q``'s
        dtype. Raises RuntimeError when called before ``plan``.
        """
