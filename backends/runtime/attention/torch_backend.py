"""Reference paged attention in plain torch: gather each sequence's pages, then SDPA. Any dtype, CPU and GPU.

Decode rows (one new token) of a step run as one padded batch, so a decode step costs a few kernels per
layer rather than a few per sequence; prefill chunks run one SDPA each.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backends.runtime.attention.base import AttentionBackend, AttentionMetadata
from backends.runtime.language_model.kv_cache import write_kv


@dataclass(frozen=True)
class _Chunk:
    q_start: int  # offset of the sequence's new tokens in the packed batch
    q_end: int
    kv_slots: torch.Tensor  # int64 [c + n], device: flat pool slots of the sequence's tokens 0 .. c+n-1
    mask: torch.Tensor  # bool [n, c + n], device: True where query j (token c + j) may attend


@dataclass(frozen=True)
class _DecodeBatch:
    q_index: torch.Tensor  # int64 [d], device: packed-token index of each decode row
    kv_slots: torch.Tensor  # int64 [d, max_kv], device: flat pool slots, padded with slot 0
    mask: torch.Tensor  # bool [d, 1, 1, max_kv], device: True for each row's real tokens


class TorchAttentionBackend(AttentionBackend):
    """The reference implementation, for tests, CPU serving and checking faster backends."""

    def __init__(self) -> None:
        self._slot_mapping: torch.Tensor | None = None
        self._chunks: list[_Chunk] = []
        self._decode: _DecodeBatch | None = None

    def plan(self, metadata: AttentionMetadata) -> None:
        device = metadata.slot_mapping.device
        page_size = metadata.page_size
        cu = metadata.cu_seqlens_q.tolist()
        indptr = metadata.kv_indptr.tolist()
        offsets = torch.arange(page_size, device=device)
        chunks, decode_rows = [], []
        for i, cached in enumerate(metadata.num_cached.tolist()):
            n = cu[i + 1] - cu[i]
            pages = metadata.kv_indices[indptr[i]:indptr[i + 1]].to(device=device, dtype=torch.int64)
            kv_slots = (pages[:, None] * page_size + offsets).flatten()[: cached + n]
            if n == 1:
                decode_rows.append((cu[i], kv_slots))
                continue
            # Query j is token cached + j of the sequence; it sees tokens 0 .. cached + j.
            mask = torch.ones(n, cached + n, dtype=torch.bool, device=device).tril(diagonal=cached)
            chunks.append(_Chunk(cu[i], cu[i + 1], kv_slots, mask))
        self._decode = None
        if decode_rows:
            max_kv = max(slots.numel() for _, slots in decode_rows)
            kv_slots = torch.zeros(len(decode_rows), max_kv, dtype=torch.int64, device=device)
            mask = torch.zeros(len(decode_rows), 1, 1, max_kv, dtype=torch.bool, device=device)
            for row, (_, slots) in enumerate(decode_rows):
                kv_slots[row, :slots.numel()] = slots
                mask[row, ..., :slots.numel()] = True
            q_index = torch.tensor([start for start, _ in decode_rows], dtype=torch.int64, device=device)
            self._decode = _DecodeBatch(q_index, kv_slots, mask)
        self._chunks = chunks
        self._slot_mapping = metadata.slot_mapping

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor) -> torch.Tensor:
        if self._slot_mapping is None:
            raise RuntimeError("TorchAttentionBackend.forward called before plan()")
        write_kv(kv_cache, layer_idx, k, v, self._slot_mapping)
        _, _, num_pages, page_size, kv_heads, head_dim = kv_cache.shape
        k_flat = kv_cache[layer_idx, 0].view(num_pages * page_size, kv_heads, head_dim)
        v_flat = kv_cache[layer_idx, 1].view(num_pages * page_size, kv_heads, head_dim)
        group = q.shape[1] // kv_heads
        out = torch.empty_like(q)
        for chunk in self._chunks:
            # [heads, tokens, head_dim], KV heads repeated for GQA as transformers' repeat_kv does.
            keys = k_flat[chunk.kv_slots].transpose(0, 1).repeat_interleave(group, dim=0).to(q.dtype)
            values = v_flat[chunk.kv_slots].transpose(0, 1).repeat_interleave(group, dim=0).to(q.dtype)
            query = q[chunk.q_start:chunk.q_end].transpose(0, 1)
            attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=chunk.mask)
            out[chunk.q_start:chunk.q_end] = attn.transpose(0, 1)
        if self._decode is not None:
            d = self._decode
            # [rows, heads, max_kv, head_dim]
            keys = k_flat[d.kv_slots].transpose(1, 2).repeat_interleave(group, dim=1).to(q.dtype)
            values = v_flat[d.kv_slots].transpose(1, 2).repeat_interleave(group, dim=1).to(q.dtype)
            query = q[d.q_index].unsqueeze(2)  # [rows, heads, 1, head_dim]
            out[d.q_index] = F.scaled_dot_product_attention(query, keys, values, attn_mask=d.mask).squeeze(2)
        return out
