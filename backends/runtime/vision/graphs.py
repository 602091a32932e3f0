"""CUDA graphs of the Qwen2.5-VL vision tower, one per item grid: a small image's encode no longer waits on the host.

On the H200 (``bench/results/peer/seventh-run-2026-12-03/README.md``) the compiled tower took 45-96 ms of the step
whatever the item's size up to about 10,000 patches: 58-96 ms for a 640x360 image's 1,196 patches, 63-75 ms for a
1280x720 one's 4,784, 59-99 ms for a 1920x1080 one's 10,764, where the GPU needs about 4, 16 and 36 ms at the tower's
300k patches/s (``bench/RESULTS.md``, "vision tower, compiled"). The host launching 32 blocks' kernels sets the pace,
as it does for a decode step. A graph replays them in one launch: on the H200, alone, a call of one 640x360 image
went from 36.5 to 5.7 ms, a 1280x720 one from 40.6 to 17.0, two 1280x720 from 59.7 to 34.2, bit for bit the same
output (``bench/results/vision-graphs-h200-2026-12-03/``).

A graph holds fixed kernels on fixed addresses, and every shape of the tower's forward (patches, windows of 8x8
patches, frames) and its rotary positions follow from an item's ``grid_thw``: one graph per grid. An item's patch rows
are copied into its graph's input buffer, the graph replayed, the merged embeddings copied out.

What a graph holds is transformers' own forward of the tower, handed the grid's metadata computed once by
transformers' own functions (:func:`grid_metadata`), which the forward takes precomputed from its keyword arguments
(``transformers.vision_utils``): without them it would compute them again with host syncs, and index the GPU's rows
with a window index built on the host. The varlen window attention's segment plan
(``backends.runtime.vision.attention``) is made by the warm-up run and found again by the capture: it is cached per
``cu_seqlens`` tensor, and the graph keeps its tensors.

When: a grid is captured the second time it is seen (a size seen once costs no capture: about two eager forwards of
host time, once per grid; the capture also synchronises the device and empties PyTorch's cache), if it has at most
``max_patches`` patches (a larger item keeps the GPU busy longer than the host takes to launch it); the most recently
used are kept, at most ``max_graphs`` graphs and ``max_total_patches`` patches in all. Items without a graph run in
one eager forward, as before. Memory outside the KV pool's count: each graph's input and output buffers (about 4 KB
a patch: at most about 270 MB with the defaults) and one memory pool shared by all graphs for their intermediates (a
graph's output is copied out at once, before another replay may reuse that memory), about the largest graph's
activations; ``tests/gpu/test_vision_graphs.py`` prints what the GPU reserved.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.utils.generic import get_max_seqlen
from transformers.vision_utils import get_vision_attention_seqlens, get_vision_position_ids, get_vision_window_index

from backends.runtime.families.base import VisionItem
from backends.runtime.language_model.graph_capture import capture_graph

log = logging.getLogger(__name__)

Grid = tuple[int, int, int]
MAX_PATCHES = 16384  # the largest item graphed (patches)
MAX_GRAPHS = 32  # graphs kept, the most recently used
MAX_TOTAL_PATCHES = 4 * MAX_PATCHES  # patches of all graphs kept (their input and output buffers: about 4 KB a patch)
CAPTURE_AFTER = 2  # the sighting of a grid that captures it


def _patches(grid: Grid) -> int:
    return grid[0] * grid[1] * grid[2]


def grid_metadata(tower: nn.Module, grid_thw: torch.Tensor) -> dict[str, torch.Tensor | int]:
    """What the tower's forward computes from ``grid_thw`` (int64 ``[items, 3]`` on the tower's device), as the
    keyword arguments that hand it over precomputed: ``position_ids``, ``cu_seqlens``, ``max_seqlen``,
    ``window_index`` (moved to the device), ``cu_window_seqlens``, ``max_window_seqlen``. Computed by the functions
    transformers' ``Qwen2_5_VisionTransformerPretrainedModel.forward`` calls, with the same arguments (host syncs
    included: call it outside a capture)."""
    position_ids = get_vision_position_ids(grid_thw, tower.spatial_merge_size)
    cu_seqlens, max_seqlen = get_vision_attention_seqlens(grid_thw, tower.config)
    window_index, cu_window_seqlens = get_vision_window_index(
        grid_thw, spatial_merge_size=tower.spatial_merge_size, window_size=tower.window_size,
        patch_size=tower.patch_size)
    return {"position_ids": position_ids, "cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen,
            "window_index": window_index.to(grid_thw.device), "cu_window_seqlens": cu_window_seqlens,
            "max_window_seqlen": get_max_seqlen(cu_window_seqlens, tower.config, kwarg_name="max_window_seqlen")}


class GraphChoice:
    """Which item grids have a CUDA graph (module docstring, "When"): the bookkeeping alone, no CUDA. ``max_patches``
    (patches), ``max_graphs``, ``capture_after`` (sightings), ``max_total_patches`` (patches) as there. Raises
    ValueError for limits below 1 or a total below ``max_patches``."""

    def __init__(self, max_patches: int = MAX_PATCHES, max_graphs: int = MAX_GRAPHS,
                 capture_after: int = CAPTURE_AFTER, max_total_patches: int = MAX_TOTAL_PATCHES) -> None:
        if min(max_patches, max_graphs, capture_after) < 1 or max_total_patches < max_patches:
            raise ValueError(f"max_patches, max_graphs and capture_after must be at least 1 and max_total_patches at "
                             f"least max_patches, got {max_patches}, {max_graphs}, {capture_after}, "
                             f"{max_total_patches}")
        self.max_patches, self.max_graphs, self.capture_after = max_patches, max_graphs, capture_after
        self.max_total_patches = max_total_patches
        self.held: OrderedDict[Grid, None] = OrderedDict()  # grids with a graph, least recently used first
        self._seen: OrderedDict[Grid, int] = OrderedDict()  # sightings of other grids (the latest 4x max_graphs)
        self._refused: set[Grid] = set()  # grids whose capture failed: eager from then on

    def see(self, grid: Grid) -> tuple[bool, tuple[Grid, ...]]:
        """One more item of ``grid``: (whether it has a graph now: held, or to capture, the ``capture_after``-th
        sighting of a grid of at most ``max_patches`` patches; the grids whose graphs to drop to make room, least
        recently used first: beyond ``max_graphs`` graphs or ``max_total_patches`` patches in all)."""
        if grid in self.held:
            self.held.move_to_end(grid)
            return True, ()
        if grid in self._refused or _patches(grid) > self.max_patches:
            return False, ()
        seen = self._seen.pop(grid, 0) + 1
        if seen < self.capture_after:
            self._seen[grid] = seen
            while len(self._seen) > 4 * self.max_graphs:
                self._seen.popitem(last=False)
            return False, ()
        dropped = []
        while self.held and (len(self.held) >= self.max_graphs
                             or sum(map(_patches, self.held)) + _patches(grid) > self.max_total_patches):
            dropped.append(self.held.popitem(last=False)[0])
        self.held[grid] = None
        return True, tuple(dropped)

    def refuse(self, grid: Grid) -> None:
        """``grid``'s capture failed: it has no graph, and never gets one."""
        self.held.pop(grid, None)
        self._refused.add(grid)


@dataclass(frozen=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    pixels: torch.Tensor  # [t*h*w, patch_dim] in the tower's dtype: the input buffer
    out: torch.Tensor  # [t*h*w / 4, out_hidden]: the merged embeddings, rewritten by each replay
    metadata: dict  # grid_metadata's tensors: the attention's cached plan is keyed by them


class VisionGraphs:
    """CUDA graphs of one Qwen2.5-VL vision tower (``model.model.visual``, prepared and compiled as ``ModelRunner``
    does, on a CUDA device) per item grid: module docstring; ``choice``: which grids (default :class:`GraphChoice`).
    Raises TypeError for another module, ValueError for a tower that is not on a CUDA device."""

    def __init__(self, tower: nn.Module, choice: GraphChoice | None = None) -> None:
        if not isinstance(tower, Qwen2_5_VisionTransformerPretrainedModel):
            raise TypeError(f"want a Qwen2.5-VL vision tower, got {type(tower).__name__}")
        weight = next(tower.parameters())
        if weight.device.type != "cuda":
            raise ValueError(f"vision graphs need a CUDA device, the tower is on {weight.device}")
        self.tower, self.device, self.dtype = tower, weight.device, weight.dtype
        self.choice = choice or GraphChoice()
        embed = tower.patch_embed
        self.patch_dim = embed.in_channels * embed.temporal_patch_size * embed.patch_size ** 2
        self._graphs: dict[Grid, _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle()

    @torch.no_grad()
    def encode_many(self, items: Sequence[VisionItem],
                    eager: Callable[[Sequence[VisionItem]], list[torch.Tensor]]) -> list[torch.Tensor]:
        """The merged embeddings of each ``(pixel rows [t*h*w, patch_dim], grid_thw)``, in order (the family's
        ``encode_batch`` contract): items whose grid has a graph (or gets one now) replay it, the others go to
        ``eager(items)`` in one call. Each result is a tensor of its own (``[t*h*w / 4, out_hidden]``, the tower's
        dtype). A capture that fails is logged and its grid runs eagerly from then on."""
        out: list[torch.Tensor | None] = [None] * len(items)
        rest = []
        for i, (pixels, grid) in enumerate(items):
            entry = self._entry(tuple(grid))
            if entry is None:
                rest.append(i)
                continue
            entry.pixels.copy_(pixels)
            entry.graph.replay()
            out[i] = entry.out.clone()  # before another replay reuses the pool's memory
        for i, embeds in zip(rest, eager([items[i] for i in rest]) if rest else ()):
            out[i] = embeds
        return out

    def _entry(self, grid: Grid) -> _Graph | None:
        graphed, dropped = self.choice.see(grid)
        for old in dropped:
            del self._graphs[old]
        if not graphed or grid in self._graphs:
            return self._graphs.get(grid)
        if not self._graphs:  # a new pool: torch cannot capture into one whose graphs are all gone
            self._pool = torch.cuda.graph_pool_handle()
        started = time.perf_counter()
        try:
            self._graphs[grid] = self._capture(grid)
            log.info("vision graph of grid_thw %s captured in %.2f s (%d held)", grid, time.perf_counter() - started,
                     len(self._graphs))
        except Exception:  # the step goes on eagerly; the grid is not tried again
            log.exception("vision graph of grid_thw %s: capture failed, the grid runs eagerly", grid)
            self.choice.refuse(grid)
            return None
        return self._graphs[grid]

    def _capture(self, grid: Grid) -> _Graph:
        grid_thw = torch.tensor([grid], dtype=torch.long, device=self.device)
        metadata = grid_metadata(self.tower, grid_thw)
        pixels = torch.zeros(_patches(grid), self.patch_dim, dtype=self.dtype, device=self.device)

        def forward() -> torch.Tensor:
            return self.tower(pixels, grid_thw=grid_thw, **metadata).pooler_output

        # no_grad, the mode the blocks were compiled in (another would recompile them); other threads of the stage
        # may use CUDA meanwhile
        graph, out = capture_graph(self.device, self._pool, forward, mode=torch.no_grad, runs=1,
                                   error_mode="thread_local")
        return _Graph(graph, pixels, out, metadata)
