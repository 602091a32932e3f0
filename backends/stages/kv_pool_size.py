"""How many KV pages decode's pool holds: the ``kv_pages`` parameter, or, when ``kv_memory_fraction`` is set, that
share of the GPU memory free once decode's weights are loaded (vLLM sizes its KV cache from GPU memory likewise).

The share is of the memory free at that moment: the other stages on the same GPU load at the same time (their
weights, their CUDA contexts), and decode's CUDA graphs and compiled kernels are made after the pool, so the
fraction must leave room for them. A pool on the CPU is sized in pages only.
"""
from __future__ import annotations

import logging

import torch

from backends.ipc.protocol import RESERVED_KV_PAGES
from backends.runtime.language_model.kv_cache import KVCacheLayout

log = logging.getLogger(__name__)


def memory_fraction(params: dict[str, str], device: torch.device) -> float | None:
    """The ``kv_memory_fraction`` parameter: None when empty (``kv_pages`` sizes the pool), else a number in (0, 1).

    Raises ValueError naming the parameter for anything else, and for a fraction on a non-CUDA device (there is no
    free GPU memory to take a share of: set ``kv_pages``)."""
    text = params.get("kv_memory_fraction", "").strip()
    if not text:
        return None
    try:
        fraction = float(text)
    except ValueError:
        raise ValueError(f"parameter kv_memory_fraction must be a number in (0, 1), got {text!r}") from None
    if not 0 < fraction < 1:
        raise ValueError(f"parameter kv_memory_fraction must be in (0, 1), got {text!r}")
    if device.type != "cuda":
        raise ValueError(f"kv_memory_fraction sizes the KV pool from free GPU memory, but decode runs on {device}: "
                         "set kv_pages instead (and kv_memory_fraction to an empty value)")
    return fraction


def pages_for_memory(free_bytes: int, fraction: float, page_bytes: int) -> int:
    """KV pages for sequences when the whole pool (them and the ``RESERVED_KV_PAGES``) may take ``fraction`` of
    ``free_bytes``: ``floor(fraction * free_bytes / page_bytes) - RESERVED_KV_PAGES``. ``page_bytes``: one page over
    all layers, K and V (``KVCacheLayout.page_bytes``).

    Raises ValueError, with the figures, when that leaves no page for sequences."""
    pages = int(fraction * free_bytes // page_bytes) - RESERVED_KV_PAGES
    if pages < 1:
        raise ValueError(f"kv_memory_fraction {fraction:g} of {free_bytes / 2**30:.2f} GiB free holds no KV page of "
                         f"{page_bytes / 2**20:.2f} MiB: raise it, or free GPU memory")
    return pages


def free_gpu_bytes(device: torch.device) -> int:
    """Bytes free on CUDA ``device`` now (``torch.cuda.mem_get_info``), after handing this process's cached, unused
    blocks back to the driver (otherwise they would count as taken)."""
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(device)
    return free


def pool_layout(model_config, dtype: torch.dtype, page_size: int, kv_pages: int, fraction: float | None,
                device: torch.device) -> KVCacheLayout:
    """The layout of decode's whole pool (``kv_pages`` for sequences plus the reserved page; with ``fraction``, as
    many pages as :func:`pages_for_memory` gives for the memory free on ``device`` now), logged. Raises ValueError
    as :func:`pages_for_memory`."""
    sized = ""
    if fraction is not None:
        page = KVCacheLayout.from_config(model_config, num_pages=1, page_size=page_size, dtype=dtype)
        free = free_gpu_bytes(device)
        kv_pages = pages_for_memory(free, fraction, page.page_bytes)
        sized = f", kv_memory_fraction {fraction:g} of {free / 2**30:.2f} GiB free"
    layout = KVCacheLayout.from_config(model_config, num_pages=kv_pages + RESERVED_KV_PAGES, page_size=page_size,
                                       dtype=dtype)
    log.info("KV pool: %d pages of %d tokens, %.2f GiB%s", kv_pages, page_size,
             layout.num_pages * layout.page_bytes / 2**30, sized)
    return layout
