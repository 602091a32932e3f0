"""Vision data parallel (issue 5): a step's items dealt over vision towers give what one tower gives (CPU: two
towers both on the CPU; the GPU case is tests/gpu/test_vision_data_parallel.py)."""
import pytest
import torch

from backends.runtime.attention import TorchAttentionBackend
from backends.runtime.language_model.kv_cache import KVCacheLayout
from backends.runtime.loader import ModelSpec, load_model
from backends.runtime.model_runner import ModelRunner
from backends.runtime.vision.data_parallel import deal


def test_items_go_largest_first_to_the_least_loaded_tower():
    assert deal([4, 16, 4, 4, 4], 2) == [[1], [0, 2, 3, 4]]
    assert deal([8, 8, 8], 3) == [[0], [1], [2]]
    assert deal([5], 3) == [[0], [], []]
    assert deal([], 2) == [[], []]


def runner(vision_devices=()) -> ModelRunner:
    torch.manual_seed(0)
    model, _ = load_model(ModelSpec())
    layout = KVCacheLayout.from_config(model.config, num_pages=3, page_size=16)
    return ModelRunner(model, torch.zeros(layout.shape), 16, TorchAttentionBackend(), vision_devices=vision_devices)


def items(seed: int = 1) -> list:
    generator = torch.Generator().manual_seed(seed)
    grids = [(1, 4, 4), (1, 8, 4), (1, 4, 4), (2, 4, 8), (1, 4, 4)]  # images and temporal groups
    return [(torch.randn(t * h * w, 1176, generator=generator), (t, h, w)) for t, h, w in grids]


def test_two_towers_give_what_one_gives():
    one, two = runner(), runner([torch.device("cpu")])
    assert two.vision is not None and len(two.vision.towers) == 2
    calls = [0, 0]
    for k, tower in enumerate(two.vision.towers):
        tower.register_forward_hook(lambda *args, k=k: calls.__setitem__(k, calls[k] + 1))
    work = items()
    expected = one.encode_many(work)
    first = two.encode_many(work)  # the first call: tower after tower, on this thread (compiles one at a time)
    got = two.encode_many(work)  # then on the towers' threads at once
    for a, b in zip(first, expected):
        torch.testing.assert_close(a, b)
    assert [e.shape for e in got] == [e.shape for e in expected] == [(p.shape[0] // 4, e.shape[1])
                                                                    for (p, _), e in zip(work, expected)]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    assert calls == [2, 2]  # both towers worked, each on its share of a call's items in one forward
    for item, batched in zip(work, expected):  # one forward for all the items gives what one per item gives
        torch.testing.assert_close(one.encode(*item), batched)
    two.vision.close()


def test_a_bad_grid_is_refused_before_any_tower_runs():
    two = runner([torch.device("cpu")])
    bad = items()[:2] + [(torch.zeros(10, 1176), (1, 4, 4))]
    with pytest.raises(ValueError, match="do not fit grid_thw"):
        two.encode_many(bad)
    two.vision.close()
