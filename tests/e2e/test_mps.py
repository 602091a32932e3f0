"""gpu_sharing mps (backends/triton/mps.py): the launcher refuses it where MPS cannot run, naming what is missing and
leaving nothing behind; on a GPU, the server starts its daemon, each stage runs with its sm_share of the SMs, requests
are served, and the daemon is gone after the stop."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from backends.triton.launcher import REPO_ROOT, TritonServer
from backends.triton.mps import CONTROL, PIPE_ENV
from backends.triton.ports import ServerPorts
from client.api import Client
from tests.e2e.conftest import assert_clean_stop, repository_with

pytestmark = pytest.mark.e2e
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.mark.skipif(shutil.which(CONTROL) is not None, reason=f"{CONTROL} is here: MPS can start")
def test_without_mps_the_launcher_says_what_is_missing_and_exits_1():
    ports = ServerPorts.unused()
    done = subprocess.run([sys.executable, "-m", "backends.triton.launcher", "--gpu-sharing", "mps", "--openai-port",
                           "0", "--http-port", str(ports.http), "--grpc-port", str(ports.grpc), "--metrics-port",
                           str(ports.metrics)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != PIPE_ENV})
    assert done.returncode == 1, done.stderr
    assert f"gpu_sharing mps needs {CONTROL}" in done.stderr and "time_slicing" in done.stderr
    assert "tritonserver ready" not in done.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or shutil.which(CONTROL) is None, reason="needs a GPU and MPS")
def test_under_mps_each_stage_gets_its_sm_share_and_serves(tmp_path, media_dir):
    repository = repository_with(tmp_path / "repository", {"decode": {"sm_share": "30"},
                                                           "encode_prefill": {"sm_share": "80",
                                                                              "mps_priority": "below_normal"}})
    server = TritonServer(repository, ports=ServerPorts.unused(), gpu_sharing="mps",
                          extra_env={"UNIFIEDSERVE_MEDIA_DIRS": str(media_dir)}).start()
    try:
        pipe = server.mps.pipe_dir
        with Client(f"127.0.0.1:{server.ports.grpc}") as client:
            assert len(client.generate("Tell me about the sea.", sampling=GREEDY,
                                       return_output_ids=True).token_ids) == 8
        log = server.log_tail(1_000_000)
        shares = {model: (share, int(sms), priority) for model, share, sms, priority in re.findall(
            r"unifiedserve\[(\w+)\] INFO MPS client, sm_share (\S+): (\d+) SMs of \S+, priority (\w+)", log)}
        assert shares["decode"][0] == "30%" and shares["encode_prefill"][0] == "80%", shares
        assert shares["decode"][1] < shares["encode_prefill"][1] <= shares["flashcodec"][1], shares
        assert shares["encode_prefill"][2] == "below_normal" and shares["decode"][2] == "normal", shares
    except BaseException:
        server.stop()
        raise
    assert_clean_stop(server)
    assert not pipe.exists()  # the daemon stopped and its folders went with the run directory
