"""Attention backends over the paged KV pool: the contract (``base``) and its implementations."""
from backends.runtime.attention.base import AttentionBackend, AttentionMetadata
from backends.runtime.attention.torch_backend import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend"]
