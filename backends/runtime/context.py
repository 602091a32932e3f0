"""The scoped forward context: what the language model's attention needs for the current step.

transformers' decoder layers call their attention function with q/k/v only; the step's paged-KV
metadata, backend and pool reach it through this context instead of through the model's arguments
(the model never sees attention metadata). A ``contextvars.ContextVar`` scopes it to the ``with`` block
and to the current thread/task, so concurrent runners cannot see each other's step.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from backends.runtime.attention.base import AttentionBackend, AttentionMetadata


@dataclass(frozen=True)
class ForwardContext:
    """One step: the planned backend, the KV pool ``[layers, 2, pages, page_size, kv_heads, head_dim]``
    and the step's metadata (already passed to ``backend.plan``)."""

    backend: AttentionBackend
    kv_cache: torch.Tensor
    metadata: AttentionMetadata


_CURRENT: ContextVar[ForwardContext | None] = ContextVar("unifiedserve_forward_context", default=None)


@contextmanager
def forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    """Make ``context`` the current one inside the ``with`` block; the previous one returns after it."""
    token = _CURRENT.set(context)
    try:
        yield context
    finally:
        _CURRENT.reset(token)


def get_forward_context() -> ForwardContext:
    """The current step's context. Raises RuntimeError outside a :func:`forward_context` block."""
    context = _CURRENT.get()
    if context is None:
        raise RuntimeError("paged attention ran outside a forward_context block (e.g. model.generate() on a "
                           "model whose language model a ModelRunner owns)")
    return context
