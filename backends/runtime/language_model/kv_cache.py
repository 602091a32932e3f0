"""The paged KV pool's layout and the block-table arithmetic (docs/structures.md, "Shared pools").

The pool is one tensor ``[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]`` (index 0 of the
second axis holds K, 1 holds V), allocated by its owner through ``backends.ipc.shared_tensor``. A sequence's
block table lists its pages: token ``i`` lives in page ``block_table[i // page_size]``, slot
``i % page_size``. Per layer, ``pool[layer, 0]`` and ``pool[layer, 1]`` are flashinfer's "NHD" paged K
and V caches ``[num_pages, page_size, num_kv_heads, head_dim]``.

The pool's last page (``backends.ipc.protocol.RESERVED_KV_PAGES``) is never handed to a sequence: the padding rows of a
CUDA-graph decode batch or prefill chunk write their keys/values there (``scratch_page``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import PreTrainedConfig

from backends.ipc.protocol import RESERVED_KV_PAGES  # at the end of the pool; the orchestrator grants the others


def scratch_page(num_pages: int) -> int:
    """The reserved page of a pool of ``num_pages`` pages (its last one)."""
    return num_pages - RESERVED_KV_PAGES


def head_dim(model_config: PreTrainedConfig) -> int:
    """Size of one attention head of the config's language model: its ``head_dim``, else hidden / heads."""
    text = model_config.get_text_config()
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


@dataclass(frozen=True)
class KVCacheLayout:
    """Shape and dtype of a KV pool. Raises ValueError for non-positive sizes."""

    num_layers: int
    num_pages: int
    page_size: int  # tokens per page
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        sizes = (self.num_layers, self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)
        if min(sizes) <= 0:
            raise ValueError(f"KV cache sizes must be positive, got {self}")

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """``(num_layers, 2, num_pages, page_size, num_kv_heads, head_dim)``."""
        return (self.num_layers, 2, self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def page_bytes(self) -> int:
        """Bytes one page takes over all layers, K and V: the unit for sizing the pool from free memory."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim * itemsize

    @classmethod
    def from_config(cls, model_config: PreTrainedConfig, num_pages: int, page_size: int,
                    dtype: torch.dtype | None = None) -> "KVCacheLayout":
        """Layout for a Qwen2.5-VL config (its ``text_config``); ``dtype`` defaults to the config's dtype."""
        text = model_config.get_text_config()
        return cls(
            num_layers=text.num_hidden_layers,
            num_pages=num_pages,
            page_size=page_size,
            num_kv_heads=text.num_key_value_heads,
            head_dim=head_dim(model_config),
            dtype=dtype or model_config.dtype or torch.float32,
        )


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` tokens."""
    return math.ceil(num_tokens / page_size)


def write_kv(kv_cache: torch.Tensor, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new keys/values in their slots.

    ``kv_cache``: the pool ``[layers, 2, pages, page_size, kv_heads, head_dim]`` (contiguous);
    ``k``/``v``: ``[n, kv_heads, head_dim]`` in the pool's dtype; ``slot_mapping``: int64 ``[n]`` flat
    slots on the pool's device.
    """
    _, _, num_pages, page_size, kv_heads, head_dim = kv_cache.shape
    kv_cache[layer_idx, 0].view(num_pages * page_size, kv_heads, head_dim)[slot_mapping] = k
    kv_cache[layer_idx, 1].view(num_pages * page_size, kv_heads, head_dim)[slot_mapping] = v
