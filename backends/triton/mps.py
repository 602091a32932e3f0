"""CUDA MPS for a server's GPU processes (``gpu_sharing: mps``): decode isolation by SM shares.

Without MPS the CUDA contexts of the stage processes on one GPU time-slice: while decode steps, an encode_prefill
step gets the GPU only between them, and the other way round (bench/RESULTS.md, "encode_prefill step beside decode":
the same step 138 ms alone, 237-270 ms beside decode). Under MPS the processes' kernels run at once, and each
process may be held to a share of the SMs (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, read by CUDA when the process
creates its context: the stages set it from their ``sm_share`` parameter before touching CUDA, in
``backends.stages.device.stage_setup``), and may be given a lower scheduling priority than the others
(``CUDA_MPS_CLIENT_PRIORITY``, from its ``mps_priority`` parameter: while its kernels and a normal client's both wait
for SMs, the normal client's go first). NVIDIA's MPS guide ("Multi-Process Service", sections on the control daemon,
the active thread percentage and the client priority) is the source of the environment variables and commands used here.

:class:`MpsDaemon` gives a server its control daemon: its own one (``nvidia-cuda-mps-control -d`` with its pipe and
log folders in the server's run directory, stopped with ``quit`` after the server), or, when the launcher's
environment names one already (``CUDA_MPS_PIPE_DIRECTORY``: a daemon the machine's operator runs), that one, left
running.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
SHARE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
PRIORITY_ENV = "CUDA_MPS_CLIENT_PRIORITY"
PRIORITIES = {"normal": "0", "below_normal": "1"}  # the guide's client priority levels and their values
GPU_SHARING = ("time_slicing", "mps")
CONTROL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class MpsDaemon:
    """An MPS control daemon the server's processes connect to: ``pipe_dir`` and ``log_dir`` (its folders),
    ``control`` (the control program), ``own`` (started for this server, so stopped with it)."""

    pipe_dir: Path
    log_dir: Path
    control: str
    own: bool

    @classmethod
    def start(cls, run_dir: Path, environ: dict[str, str] | None = None) -> "MpsDaemon":
        """The daemon named by ``environ`` (default ``os.environ``) in ``CUDA_MPS_PIPE_DIRECTORY``, or a new one with
        its folders in ``run_dir``. Raises RuntimeError when the control program is not on PATH (it comes with the
        NVIDIA driver's utilities) or the daemon does not start (its message and log folder named)."""
        environ = os.environ if environ is None else environ
        if environ.get(PIPE_ENV):
            return cls(Path(environ[PIPE_ENV]), Path(environ.get(LOG_ENV, environ[PIPE_ENV])), CONTROL, own=False)
        control = shutil.which(CONTROL, path=environ.get("PATH"))
        if control is None:
            raise RuntimeError(f"gpu_sharing mps needs {CONTROL} (the NVIDIA driver's MPS control program) on PATH; "
                               "without it, serve with gpu_sharing time_slicing (--gpu-sharing time_slicing)")
        daemon = cls(run_dir / "mps-pipe", run_dir / "mps-log", control, own=True)
        daemon.pipe_dir.mkdir(parents=True, exist_ok=True)
        daemon.log_dir.mkdir(parents=True, exist_ok=True)
        done = daemon._control(["-d"])
        if done.returncode != 0:
            raise RuntimeError(f"{CONTROL} -d failed with status {done.returncode}: {done.stdout.strip()} "
                               f"(log folder {daemon.log_dir})")
        return daemon

    def env(self) -> dict[str, str]:
        """The variables that make a process a client of this daemon."""
        return {PIPE_ENV: str(self.pipe_dir), LOG_ENV: str(self.log_dir)}

    def stop(self) -> None:
        """Stop the daemon if this server started it (its clients have exited); one it found is left running."""
        if self.own:
            self._control([], stdin="quit\n")

    def _control(self, args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([self.control, *args], input=stdin, env={**os.environ, **self.env()}, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=CONTROL_TIMEOUT_S)


def sm_share(params: dict[str, str]) -> int | None:
    """A stage's ``sm_share`` parameter: the percentage (1-100) of the GPU's SMs its process may use under MPS, or
    None (empty or absent: no limit). Raises ValueError naming the parameter for anything else."""
    text = params.get("sm_share", "").strip()
    if not text:
        return None
    if not text.isdigit() or not 1 <= int(text) <= 100:
        raise ValueError(f"sm_share must be a whole percentage from 1 to 100 (or empty: no limit), got {text!r}")
    return int(text)


def mps_priority(params: dict[str, str]) -> str | None:
    """A stage's ``mps_priority`` parameter: ``normal`` or ``below_normal``, the MPS client priority its process takes
    (NVIDIA's MPS guide, ``CUDA_MPS_CLIENT_PRIORITY``), or None (empty or absent: CUDA's default, normal). Raises
    ValueError naming the parameter for anything else."""
    text = params.get("mps_priority", "").strip()
    if text and text not in PRIORITIES:
        raise ValueError(f"mps_priority must be {' or '.join(PRIORITIES)} (or empty: normal), got {text!r}")
    return text or None
