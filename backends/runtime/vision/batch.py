"""Several items through one Qwen2.5-VL vision tower in one forward, as transformers' model runs all the images (or
videos) of a prompt: the tower takes one ``grid_thw`` row per item and attends within each (its ``cu_seqlens``), so
the result equals one forward per item, with one call's kernel launches and its larger matrix products instead of one
per item (bench/RESULTS.md, "vision tower, compiled": 16 images in one forward).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

Item = tuple[torch.Tensor, tuple[int, int, int]]  # (pixel_values float [t*h*w, 1176], grid_thw (t, h, w))


@torch.no_grad()
def encode_batch(tower: nn.Module, items: Sequence[Item]) -> list[torch.Tensor]:
    """The embeddings of each item, in order: ``[t*h*w / merge**2, out_hidden]`` each, in the tower's dtype, on its
    device (the patches are moved there). An empty ``items`` gives an empty list."""
    if not items:
        return []
    weight = next(tower.parameters())
    pixels = torch.cat([p.to(weight.device, weight.dtype) for p, _ in items])
    grid = torch.tensor([g for _, g in items], dtype=torch.long, device=weight.device)
    merged = tower.spatial_merge_size ** 2
    out = tower(pixels, grid_thw=grid).pooler_output
    return list(out.split([t * h * w // merged for _, (t, h, w) in items]))
