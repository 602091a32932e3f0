"""Vision data parallel on two GPUs (issue 5): the 7B architecture's tower on GPU 0 and a copy on GPU 1 give, item
for item, what the tower on GPU 0 alone gives, and both GPUs take items. Run on the device:
`python3 -m pytest -q tests/gpu/test_vision_data_parallel.py` (skipped below two GPUs)."""
import pytest
import torch

from backends.runtime.attention import TorchAttentionBackend
from backends.runtime.language_model.kv_cache import KVCacheLayout
from backends.runtime.loader import ModelSpec, load_model
from backends.runtime.model_runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs or more"),
]


def test_two_gpus_give_what_one_gives():
    model, _ = load_model(ModelSpec(preset="qwen2_5_vl_7b", dtype="bfloat16", device="cuda:0"))
    layout = KVCacheLayout.from_config(model.config, num_pages=3, page_size=16, dtype=model.dtype)
    pool = torch.zeros(layout.shape, dtype=layout.dtype, device="cuda:0")
    runner = ModelRunner(model, pool, 16, TorchAttentionBackend(), vision_devices=[torch.device("cuda:1")])
    generator = torch.Generator().manual_seed(0)
    work = [(torch.randn(t * h * w, 1176, generator=generator), (t, h, w))
            for t, h, w in [(1, 36, 64), (1, 36, 64), (2, 18, 32), (1, 16, 16)]]
    towers = [0, 0]
    for k, tower in enumerate(runner.vision.towers):
        tower.register_forward_hook(lambda *args, k=k: towers.__setitem__(k, towers[k] + 1))
    first = runner.encode_many(work)  # tower after tower on this thread: each compiles alone
    got = runner.encode_many(work)  # both towers at once, on their threads
    alone = [runner.encode(p, g) for p, g in work]  # GPU 0's tower only
    assert towers[1] > 0 and towers[0] > len(work)  # GPU 1 took items; GPU 0 took some and ran them all again
    for a, b in zip(first + got, alone + alone):
        assert a.device == b.device == torch.device("cuda:0")
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)  # same weights and kernels; bf16 on two GPUs
    runner.vision.close()
