"""Vision graphs on the GPU (backends/runtime/vision/graphs.py): the 7B architecture's tower, prepared and compiled as
the encode_prefill stage runs it, gives through its CUDA graphs what its eager forward gives, item for item, in a step
that mixes graphed and eager items. Run on the device: `python3 -m pytest -q -rP tests/gpu/test_vision_graphs.py`."""
import pytest
import torch
from transformers import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

from backends.runtime.families.qwen2_5_vl import Qwen2_5_VL
from backends.runtime.presets import PRESETS
from backends.runtime.vision.graphs import GraphChoice, VisionGraphs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FAMILY = Qwen2_5_VL()
# 640x360 and 1280x720 images (smart_resize), two frames of a small video, an image too large to graph (limit below)
SMALL, MEDIUM, VIDEO, LARGE = (1, 26, 46), (1, 52, 92), (2, 20, 36), (1, 78, 138)


@pytest.fixture(scope="module")
def tower() -> Qwen2_5_VisionTransformerPretrainedModel:
    config = Qwen2_5_VLVisionConfig(**PRESETS["qwen2_5_vl_7b"]["vision_config"])
    torch.manual_seed(0)
    tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(config, dtype=torch.bfloat16).cuda().eval()
    FAMILY.prepare_vision(tower)
    FAMILY.compile_vision(tower)
    return tower


def _items(*grids, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(t * h * w, 1176, generator=generator, device="cuda"), (t, h, w)) for t, h, w in grids]


def _eager(tower, items):
    with torch.no_grad():
        return [FAMILY.encode_batch(tower, [item])[0] for item in items]


def test_graphs_give_what_the_eager_forward_gives(tower):
    choice = GraphChoice(max_patches=MEDIUM[1] * MEDIUM[2], max_graphs=8, capture_after=2)
    graphs = VisionGraphs(tower, choice)
    eager_calls = []

    def eager(items):
        eager_calls.append([grid for _, grid in items])
        return FAMILY.encode_batch(tower, items)

    reserved = torch.cuda.memory_reserved()
    for seed in range(3):  # SMALL's second item captures in the first step; the other small grids in the second
        items = _items(SMALL, LARGE, MEDIUM, VIDEO, SMALL, seed=seed)
        got = graphs.encode_many(items, eager)
        want = _eager(tower, items)
        for (_, grid), a, b in zip(items, got, want):
            assert a.shape == b.shape and a.dtype == b.dtype == torch.bfloat16
            difference = (a.float() - b.float()).abs().max().item()
            print(f"step {seed} grid {grid}: max |graph - eager| {difference:.3g} (exact: {torch.equal(a, b)})")
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
        assert got[0].data_ptr() != got[4].data_ptr()  # each item's result is its own
    assert eager_calls[0] == [SMALL, LARGE, MEDIUM, VIDEO]  # first sightings; the second SMALL replays its graph
    assert eager_calls[1] == eager_calls[2] == [LARGE]  # over max_patches: always eager
    assert set(graphs.choice.held) == {SMALL, MEDIUM, VIDEO}
    print(f"graphs {sorted(graphs.choice.held)}: {(torch.cuda.memory_reserved() - reserved) / 2**20:.0f} MiB more "
          "reserved (pool and eager activations)")


def test_a_dropped_graph_is_captured_again_when_its_grid_returns(tower):
    choice = GraphChoice(max_patches=10 ** 5, max_graphs=1, capture_after=1, max_total_patches=10 ** 5)
    graphs = VisionGraphs(tower, choice)
    for grid in (SMALL, VIDEO, SMALL):
        items = _items(grid, seed=7)
        got = graphs.encode_many(items, lambda items: pytest.fail("every grid is graphed at its first sighting"))
        torch.testing.assert_close(got[0], _eager(tower, items)[0], rtol=2e-2, atol=2e-2)
        assert graphs.choice.held == {grid: None}
