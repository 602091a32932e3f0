"""Vision tensor parallel (issue 5): the tower split over ranks gives what the whole tower gives. CPU: rank 0 in
this process and a helper process on the CPU, collectives over gloo (the GPU case, NCCL, is
tests/gpu/test_vision_tensor_parallel.py)."""
import copy

import pytest
import torch
import torch.distributed as dist

from backends.runtime.attention import TorchAttentionBackend
from backends.runtime.language_model.kv_cache import KVCacheLayout
from backends.runtime.loader import ModelSpec, load_model
from backends.runtime.model_runner import ModelRunner
from backends.runtime.vision.data_parallel import deal
from backends.runtime.vision.tensor_parallel import RowParallelLinear, VisionTensorParallel, prepare_for_tp, shard_vision_tower
from tests.unit.backends.runtime.vision.test_data_parallel import items


def runner(**kwargs) -> ModelRunner:
    torch.manual_seed(0)
    model, _ = load_model(ModelSpec())
    layout = KVCacheLayout.from_config(model.config, num_pages=3, page_size=16)
    return ModelRunner(model, torch.zeros(layout.shape), 16, TorchAttentionBackend(), **kwargs)


def test_a_split_tower_gives_what_the_whole_one_gives():
    whole, split = runner(), runner(vision_tp=[torch.device("cpu")])
    try:
        assert split.vision_tp.world == 2 and dist.get_world_size() == 2
        block = split._visual.blocks[0]
        heads = whole._visual.blocks[0].attn.num_heads
        assert block.attn.num_heads == heads // 2 and isinstance(block.attn.proj, RowParallelLinear)
        assert block.mlp.gate_proj.out_features * 2 == whole._visual.blocks[0].mlp.gate_proj.out_features
        work = items()
        for (pixel_values, grid), expected in zip(work, whole.encode_many(work)):
            got = split.encode(pixel_values, grid)
            assert got.shape == expected.shape
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    finally:
        split.close()
    assert not dist.is_initialized() and all(h.returncode == 0 for h in split.vision_tp.helpers)


def test_two_split_towers_share_the_items_and_give_what_the_whole_one_gives():
    """Hybrid parallel: 4 ranks in towers of 2 (DP2 x TP2 over gloo): each tower's items, the second tower's sent
    back to rank 0 by its first rank, equal the whole tower's, in item order."""
    work = items()
    assert all(deal([int(p.shape[0]) for p, _ in work], 2))  # both towers get items
    whole, hybrid = runner(), runner(vision_tp=[torch.device("cpu")] * 3, vision_tp_size=2)
    try:
        assert hybrid.vision_tp.world == 4 and hybrid.vision_tp.towers == 2
        assert hybrid._visual.blocks[0].attn.num_heads * 2 == whole._visual.blocks[0].attn.num_heads
        for _ in range(2):  # a second call after the first: the ranks stay paired
            for got, expected in zip(hybrid.encode_many(work), whole.encode_many(work)):
                assert got.shape == expected.shape
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert hybrid.encode_many([]) == []
        single = hybrid.encode(*work[3])  # one item: the other tower has nothing to do
        torch.testing.assert_close(single, whole.encode(*work[3]), rtol=1e-5, atol=1e-5)
    finally:
        hybrid.close()
    assert not dist.is_initialized() and all(h.returncode == 0 for h in hybrid.vision_tp.helpers)


def test_towers_that_do_not_divide_the_ranks_are_refused():
    model, _ = load_model(ModelSpec())
    with pytest.raises(ValueError, match="multiple"):
        VisionTensorParallel(model.model.visual, [torch.device("cpu")] * 2, None, tp=2)
    assert not dist.is_initialized()


def test_shards_sum_to_the_whole_block():
    """The arithmetic alone, in one process: each rank's partial output of a block's MLP and attention projection,
    summed as the all-reduce would, equals the unsplit layer (no process group: the all-reduce is the sum here)."""
    model, _ = load_model(ModelSpec())
    visual = model.model.visual
    prepare_for_tp(visual, 2)
    x = torch.randn(16, visual.config.hidden_size)
    mlp = visual.blocks[0].mlp
    expected = mlp(x)
    partial = []
    for rank in range(2):
        shard = copy.deepcopy(visual)
        shard_vision_tower(shard, rank, 2)
        m = shard.blocks[0].mlp
        h = m.act_fn(m.gate_proj(x)) * m.up_proj(x)
        partial.append(torch.nn.functional.linear(h, m.down_proj.weight))
    torch.testing.assert_close(partial[0] + partial[1] + mlp.down_proj.bias, expected, rtol=1e-5, atol=1e-5)


def test_heads_that_do_not_split_are_refused():
    model, _ = load_model(ModelSpec())
    visual = model.model.visual
    prepare_for_tp(visual, 3)
    with pytest.raises(ValueError, match="divisible"):
        shard_vision_tower(visual, 0, 3)


def test_data_and_tensor_parallel_together_are_refused():
    with pytest.raises(ValueError, match="not both"):
        runner(vision_devices=[torch.device("cpu")], vision_tp=[torch.device("cpu")])


def test_a_helper_that_dies_takes_the_tower_out_of_service_without_a_hang():
    split = runner(vision_tp=[torch.device("cpu")])
    pixel_values, grid = items()[0]
    try:
        split.encode(pixel_values, grid)
        helper = split.vision_tp.helpers[0]
        helper.kill()
        helper.wait()
        for _ in range(2):
            with pytest.raises(RuntimeError, match="out of service"):
                split.encode(pixel_values, grid)
        assert not dist.is_initialized()
    finally:
        split.close()


@pytest.mark.parametrize("parallel, size", [("data", 2), ("tensor", 3)])
def test_the_stage_refuses_a_tower_size_that_does_not_fit(parallel, size):
    from backends.stages.encode_prefill_worker import EncodePrefillWorker

    with pytest.raises(ValueError, match="vision_tp_size"):
        EncodePrefillWorker(ModelSpec(), torch.device("cpu"), vision_devices=[torch.device("cpu")],
                            vision_parallel=parallel, vision_tp_size=size)
