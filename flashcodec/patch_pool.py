"""The paged patch pool layout (docs/structures.md): `pool` is [num_pages, page_size, patch_dim] float32, `patch_dim`
the served family's values per patch row (`flashcodec.families`: Qwen2.5-VL 1176, InternVL3 588).

A temporal-patch group's n patch rows fill its pages in order: row i is in `pages[i // page_size]`, slot
`i % page_size`; only the last page is partly used. Pages come from the pool's free list
(backends/ipc/shared_pages.py), taken once a group is decoded; this module only places rows, it never
allocates. `PVLayout` describes many groups in the paper's terms.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


def pages_needed(num_patches: int, page_size: int) -> int:
    """ceil(num_patches / page_size): pages one group of `num_patches` rows occupies. Raises ValueError if < 0."""
    if num_patches < 0 or page_size < 1:
        raise ValueError(f"num_patches must be >= 0 and page_size >= 1, got {num_patches}, {page_size}")
    return -(-num_patches // page_size)


def _check(pool: torch.Tensor, pages: Sequence[int], n: int) -> int:
    if pool.dim() != 3:
        raise ValueError(f"pool must be [num_pages, page_size, patch_dim], got {list(pool.shape)}")
    need = pages_needed(n, pool.shape[1])
    if len(pages) < need:
        raise ValueError(f"{n} patch rows need {need} pages of {pool.shape[1]}, got {len(pages)}")
    used = list(pages[:need])
    if len(set(used)) != need or any(not 0 <= p < pool.shape[0] for p in used):
        raise ValueError(f"pages must be distinct indices in [0, {pool.shape[0]}), got {used}")
    return need


def write_group(pool: torch.Tensor, pages: Sequence[int], patches: torch.Tensor) -> None:
    """Copy `patches` [n, patch_dim] into `pool` over the first ceil(n / page_size) of `pages`, in order.

    Raises ValueError if the pool or patches have the wrong shape, or the pages cannot hold n rows
    (too few, repeated, or out of range). Slots after row n in the last page are left as they were.
    """
    need = _check(pool, pages, patches.shape[0])
    if patches.dim() != 2 or patches.shape[1] != pool.shape[2]:
        raise ValueError(f"patches must be [n, {pool.shape[2]}] (the pool's patch_dim), got {list(patches.shape)}")
    size = pool.shape[1]
    for k in range(need):
        rows = patches[k * size : (k + 1) * size]
        pool[pages[k], : rows.shape[0]].copy_(rows)


def read_group(pool: torch.Tensor, pages: Sequence[int], n: int) -> torch.Tensor:
    """The n rows written by `write_group(pool, pages, ...)`: a new [n, patch_dim] tensor on the pool's device.

    Raises ValueError as `write_group` does.
    """
    need = _check(pool, pages, n)
    index = torch.tensor(list(pages[:need]), dtype=torch.long, device=pool.device)
    return pool.index_select(0, index).reshape(-1, pool.shape[2])[:n]


@dataclass(frozen=True)
class PVLayout:
    """Pages of many groups (int32, CPU), flashinfer-style CSR in the paper's names.

    Group g's pages are `PV_page_indices[PV_indptr[g]:PV_indptr[g + 1]]`; its rows are
    `PV_cu_page_len[g + 1] - PV_cu_page_len[g]`, and it starts at row `PV_cu_page_len[g]` of the concatenation.
    """

    PV_indptr: torch.Tensor  # [num_groups + 1]
    PV_page_indices: torch.Tensor  # [total pages]
    PV_cu_page_len: torch.Tensor  # [num_groups + 1], cumulative valid patch rows


def pv_layout(groups: Sequence[tuple[Sequence[int], int]], page_size: int) -> PVLayout:
    """`PVLayout` of `groups`, each `(pages, num_patches)`; only the ceil(num_patches / page_size) pages used.

    Raises ValueError if a group has fewer pages than its rows need.
    """
    indptr, indices, cu_len = [0], [], [0]
    for pages, n in groups:
        need = pages_needed(n, page_size)
        if len(pages) < need:
            raise ValueError(f"{n} patch rows need {need} pages of {page_size}, got {len(pages)}")
        indices.extend(pages[:need])
        indptr.append(len(indices))
        cu_len.append(cu_len[-1] + n)
    return PVLayout(
        torch.tensor(indptr, dtype=torch.int32),
        torch.tensor(indices, dtype=torch.int32),
        torch.tensor(cu_len, dtype=torch.int32),
    )
