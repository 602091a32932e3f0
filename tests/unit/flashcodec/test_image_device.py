"""An image's patch rows are normalised and cut on the device flashcodec hands them to (its patch pool's), after the
resize on the CPU (flashcodec.preprocess.image_patches, families' image_groups): here the plumbing, on the CPU and
on PyTorch's shape-only "meta" device; tests/gpu/test_image_rows_cuda.py checks on a GPU that the values are the
CPU's, bit for bit."""
from __future__ import annotations

import pytest
import torch

from flashcodec.families import family
from flashcodec.pipeline import iter_image_groups
from flashcodec.probe import probe_image
from tests.media import make_image


@pytest.mark.parametrize("name, rows, width", [("qwen2_5_vl", 4784, 1176), ("internvl3", 1024, 588)])
def test_rows_land_on_the_device_asked_for_with_the_shape_of_the_cpus(name, rows, width):
    data = make_image(1280, 720, "RGB", "JPEG")
    plan = family(name).plan_image(probe_image(data))
    on_cpu = list(iter_image_groups(data, plan))
    assert all(r.device.type == "cpu" and r.shape == (rows, width) for _, r in on_cpu)
    explicit = list(iter_image_groups(data, plan, torch.device("cpu")))
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(on_cpu, explicit))
    on_meta = list(iter_image_groups(data, plan, "meta"))
    assert [g for g, _ in on_meta] == [g for g, _ in on_cpu]
    assert all(r.device.type == "meta" and r.shape == c.shape and r.dtype == torch.float32
               for (_, r), (_, c) in zip(on_meta, on_cpu))
