"""decode's KV pool sized as a share of the GPU memory free once its weights are loaded.

Run on the device: `python3 -m pytest -q -m gpu tests/gpu/test_kv_memory_fraction.py` (skipped without CUDA).
"""
import pytest
import torch

from backends.ipc.protocol import RESERVED_KV_PAGES
from backends.ipc.run_dir import RUN_DIR_ENV
from backends.runtime.loader import ModelSpec
from backends.stages.decode_worker import DecodeWorker
from backends.stages.kv_pool_size import free_gpu_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_the_pool_takes_the_share_of_free_memory(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    caplog.set_level("INFO", logger="backends.stages.kv_pool_size")  # pool_layout logs the sizing
    device = torch.device("cuda", 0)
    free_before = free_gpu_bytes(device)  # the tiny model's weights take a few MB of it
    worker = DecodeWorker(ModelSpec(device=str(device)), device, kv_pages=8, page_size=16, max_batch=4,
                          attention_backend="torch", kv_memory_fraction=0.05, lm_weights=None)
    try:
        pool = worker.pool.tensor  # [layers, 2, pages, page_size, kv_heads, head_dim]
        pool_bytes = pool.numel() * pool.element_size()
        assert pool.shape[2] - RESERVED_KV_PAGES > 8  # sized from memory, not from kv_pages
        assert 0.05 * free_before * 0.98 <= pool_bytes <= 0.05 * free_before
        assert "kv_memory_fraction 0.05 of" in caplog.text
    finally:
        worker.shutdown()
