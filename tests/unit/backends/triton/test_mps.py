"""MPS for a server's processes (backends/triton/mps.py): a stage's sm_share, the daemon found or refused. A daemon
started for real, and the SM shares it gives, are tested on the GPU (tests/e2e/test_mps.py)."""
from __future__ import annotations

import pytest

from backends.triton import mps


@pytest.mark.parametrize("text, share", [("", None), (" ", None), ("40", 40), ("100", 100), ("1", 1)])
def test_sm_share_is_a_percentage_or_no_limit(text, share):
    assert mps.sm_share({"sm_share": text}) == share
    assert mps.sm_share({}) is None


@pytest.mark.parametrize("text", ["0", "101", "half", "40%", "-5", "2.5"])
def test_a_bad_sm_share_is_refused_by_name(text):
    with pytest.raises(ValueError, match=r"sm_share must be a whole percentage from 1 to 100"):
        mps.sm_share({"sm_share": text})


@pytest.mark.parametrize("text, priority", [("", None), ("normal", "normal"), (" below_normal ", "below_normal")])
def test_mps_priority_is_a_client_priority_level_or_the_default(text, priority):
    assert mps.mps_priority({"mps_priority": text}) == priority
    assert mps.mps_priority({}) is None
    assert priority is None or mps.PRIORITIES[priority] in ("0", "1")  # CUDA_MPS_CLIENT_PRIORITY's values


@pytest.mark.parametrize("text", ["high", "low", "1", "BELOW_NORMAL"])
def test_a_bad_mps_priority_is_refused_by_name(text):
    with pytest.raises(ValueError, match=r"mps_priority must be normal or below_normal"):
        mps.mps_priority({"mps_priority": text})


def test_a_daemon_the_environment_names_is_used_and_left_running(tmp_path):
    environ = {mps.PIPE_ENV: str(tmp_path / "pipe"), mps.LOG_ENV: str(tmp_path / "log"), "PATH": ""}
    daemon = mps.MpsDaemon.start(tmp_path / "run", environ)
    assert not daemon.own
    assert daemon.env() == {mps.PIPE_ENV: str(tmp_path / "pipe"), mps.LOG_ENV: str(tmp_path / "log")}
    daemon.stop()  # nothing to run: the control program is not even on PATH
    assert not (tmp_path / "run").exists()


def test_without_the_control_program_mps_is_refused_with_what_to_do(tmp_path):
    with pytest.raises(RuntimeError, match=r"nvidia-cuda-mps-control .* on PATH; without it, serve with "
                                            r"gpu_sharing time_slicing"):
        mps.MpsDaemon.start(tmp_path, {"PATH": str(tmp_path)})
