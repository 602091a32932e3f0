"""Attention backends over the paged KV pool: the contract (``base``), its implementations, and the choice."""
from __future__ import annotations

import torch
from transformers import PreTrainedConfig

from backends.runtime.attention.base import AttentionBackend, AttentionMetadata
from backends.runtime.attention.flashinfer_backend import FlashInferAttentionBackend, flashinfer_supports
from backends.runtime.attention.torch_backend import TorchAttentionBackend
from backends.runtime.language_model.kv_cache import head_dim

BACKENDS = ("auto", "torch", "flashinfer")

__all__ = ["AttentionBackend", "AttentionMetadata", "BACKENDS", "FlashInferAttentionBackend",
           "TorchAttentionBackend", "make_backend"]


def make_backend(name: str, model_config: PreTrainedConfig, page_size: int, dtype: torch.dtype,
                 device: torch.device) -> AttentionBackend:
    """The language model's attention backend.

    ``name``: ``"torch"`` (the reference: any dtype and device), ``"flashinfer"`` (CUDA, float16/bfloat16,
    head_dim 64/128/256), or ``"auto"``: flashinfer where it can run this model here, else torch.
    Raises ValueError for an unknown name, or ``"flashinfer"`` where it cannot run (the reason is named).
    """
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    text, size = model_config.get_text_config(), head_dim(model_config)
    if name == "torch" or (name == "auto" and flashinfer_supports(size, dtype, device)):
        return TorchAttentionBackend()
    return FlashInferAttentionBackend(text.num_attention_heads, text.num_key_value_heads, size, page_size,
                                      dtype, device)
