"""Pools shared between processes (backends/ipc/shared_tensor.py): what one process writes, the other sees."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backends.ipc.run_dir import RUN_DIR_ENV
from backends.ipc import shared_tensor


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "run"))
    return tmp_path / "run"


def test_another_process_maps_and_writes_the_pool(run_dir):
    owner = shared_tensor.create("pool", (4, 3, 2), torch.float32, torch.device("cpu"))
    try:
        assert shared_tensor.describe("pool")["shape"] == [4, 3, 2]
        code = ("from backends.ipc import shared_tensor; t = shared_tensor.open_('pool').tensor; "
                "assert t.shape == (4, 3, 2); t[2, 1, 0] = 7.5")
        subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[4])
        assert owner.tensor[2, 1, 0].item() == 7.5 and owner.tensor.sum().item() == 7.5
    finally:
        owner.release()
    assert not any(run_dir.glob("pool.*")) and owner.shm_path is not None and not owner.shm_path.exists()


def test_waiting_for_a_pool_that_never_appears_times_out(run_dir):
    run_dir.mkdir()
    with pytest.raises(TimeoutError, match="never_published"):
        shared_tensor.open_("never_published", timeout_s=0.2)


def test_run_dir_must_be_set(monkeypatch):
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    with pytest.raises(RuntimeError, match="UNIFIEDSERVE_RUN_DIR"):
        shared_tensor.run_dir()
