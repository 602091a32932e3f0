"""An image's patch rows computed for a GPU patch pool (flashcodec.pipeline.iter_image_groups with the pool's
device: the CPU resizes, the GPU normalises and cuts) equal the CPU's bit for bit, for both families.

Run on the device: `python3 -m pytest -q -m gpu tests/gpu/test_image_rows_cuda.py` (skipped without CUDA)."""
from __future__ import annotations

import pytest
import torch

from flashcodec.families import family
from flashcodec.pipeline import iter_image_groups
from flashcodec.probe import probe_image
from tests.media import make_image

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("name", ["qwen2_5_vl", "internvl3"])
@pytest.mark.parametrize("width, height, mode, fmt", [(1280, 720, "RGB", "JPEG"), (640, 360, "RGBA", "PNG"),
                                                      (1920, 1080, "RGB", "JPEG"), (33, 901, "L", "PNG")])
def test_gpu_rows_are_the_cpus(name, width, height, mode, fmt):
    data = make_image(width, height, mode, fmt)
    plan = family(name).plan_image(probe_image(data))
    cpu = list(iter_image_groups(data, plan))
    gpu = list(iter_image_groups(data, plan, torch.device("cuda", 0)))
    assert [g for g, _ in gpu] == [g for g, _ in cpu]
    for (_, a), (_, b) in zip(cpu, gpu):
        assert b.is_cuda
        torch.testing.assert_close(b.cpu(), a, atol=0, rtol=0)
