"""The vision graphs' CPU parts: the tower's forward with transformers' metadata handed over precomputed
(``grid_metadata``: what a graph captures) equals the plain forward; which grids get a graph (``GraphChoice``); the
graphs refuse a tower they cannot run. The graphs themselves: tests/gpu/test_vision_graphs.py."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

from backends.runtime.presets import PRESETS
from backends.runtime.vision.attention import use_varlen_vision_attention
from backends.runtime.vision.graphs import GraphChoice, VisionGraphs, grid_metadata


def _tower() -> Qwen2_5_VisionTransformerPretrainedModel:
    config = Qwen2_5_VLVisionConfig(**PRESETS["tiny"]["vision_config"])
    with torch.random.fork_rng():
        torch.manual_seed(0)
        tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(config, dtype=torch.float32)
    use_varlen_vision_attention(tower)  # the attention the stage runs (its name asks for cu_seqlens)
    return tower.eval()


@pytest.mark.parametrize("grid", [(1, 16, 16), (1, 10, 14), (2, 10, 14), (1, 36, 20)])
def test_the_forward_with_precomputed_metadata_equals_the_plain_forward(grid):
    tower = _tower()
    grid_thw = torch.tensor([grid])
    pixels = torch.randn(grid[0] * grid[1] * grid[2], 1176, generator=torch.Generator().manual_seed(1))
    metadata = grid_metadata(tower, grid_thw)
    assert set(metadata) == {"position_ids", "cu_seqlens", "max_seqlen", "window_index", "cu_window_seqlens",
                             "max_window_seqlen"}
    assert isinstance(metadata["max_seqlen"], int) and isinstance(metadata["max_window_seqlen"], int)
    with torch.no_grad():
        plain = tower(pixels, grid_thw=grid_thw).pooler_output
        given = tower(pixels, grid_thw=grid_thw, **metadata).pooler_output
        again = tower(pixels, grid_thw=grid_thw, **metadata).pooler_output  # the forward leaves the metadata be
    assert plain.shape == (grid[0] * grid[1] * grid[2] // 4, tower.merger.mlp[-1].out_features)
    assert torch.equal(given, plain) and torch.equal(again, plain)


def test_a_grid_gets_a_graph_at_its_second_sighting_and_the_least_recently_used_makes_room():
    choice = GraphChoice(max_patches=1000, max_graphs=2, capture_after=2)
    a, b, c = (1, 10, 10), (1, 12, 12), (2, 10, 10)
    assert choice.see(a) == (False, ())  # first sighting: eager
    assert choice.see(a) == (True, ())  # second: captured
    assert choice.see(a) == (True, ())  # replayed
    assert choice.see(b) == (False, ()) and choice.see(b) == (True, ())
    assert choice.see(a) == (True, ())  # a is now the most recently used
    assert choice.see(c) == (False, ()) and choice.see(c) == (True, (b,))  # room made: b, the least recently used
    assert list(choice.held) == [a, c]
    assert choice.see(b) == (False, ())  # b starts over


def test_the_graphs_patches_in_all_are_bounded_too():
    choice = GraphChoice(max_patches=100, max_graphs=8, capture_after=1, max_total_patches=250)
    a, b, c = (1, 10, 10), (1, 8, 10), (1, 9, 10)  # 100, 80, 90 patches
    assert choice.see(a) == (True, ()) and choice.see(b) == (True, ())
    assert choice.see(c) == (True, (a,))  # 270 > 250: the least recently used goes
    assert list(choice.held) == [b, c]


def test_large_grids_run_eagerly_and_a_failed_capture_is_not_tried_again():
    choice = GraphChoice(max_patches=100, max_graphs=4, capture_after=1)
    assert choice.see((1, 10, 12)) == (False, ())  # 120 patches: over the limit
    assert choice.see((1, 10, 10)) == (True, ())  # capture_after 1: the first sighting captures
    choice.refuse((1, 10, 10))
    assert choice.see((1, 10, 10)) == (False, ()) and not choice.held


def test_sightings_are_remembered_for_a_bounded_number_of_grids():
    choice = GraphChoice(max_patches=10 ** 6, max_graphs=1, capture_after=2, max_total_patches=10 ** 6)
    choice.see((1, 2, 2))
    for k in range(1, 5):  # four more grids: the first one's sighting is forgotten (4 x max_graphs kept)
        choice.see((1, 2, 2 * k + 2))
    assert choice.see((1, 2, 2)) == (False, ())


@pytest.mark.parametrize("limits", [(0, 1, 1, 1), (1, 0, 1, 1), (1, 1, 0, 1), (2, 1, 1, 1)])
def test_limits_below_one_are_refused(limits):
    with pytest.raises(ValueError, match="must be at least 1 and max_total_patches at least max_patches"):
        GraphChoice(*limits)


def test_the_graphs_refuse_a_cpu_tower_and_another_module():
    with pytest.raises(ValueError, match="vision graphs need a CUDA device, the tower is on cpu"):
        VisionGraphs(_tower())
    with pytest.raises(TypeError, match="want a Qwen2.5-VL vision tower, got Linear"):
        VisionGraphs(torch.nn.Linear(2, 2))
