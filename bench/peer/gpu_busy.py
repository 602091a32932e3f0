"""How busy the GPU was during a scenario (issue 20, item 1: the GPU's busy time beside the request timeline), for
either system: ``nvidia-smi`` sampling NVML's utilization counters every ``PERIOD_MS`` ms (``utilization.gpu``: the
share of the sample period in which a kernel ran; ``utilization.decoder``: the NVDEC engines'), as
``nvidia-smi --help-query-gpu`` defines them. Without ``nvidia-smi`` (the CPU machines) nothing is sampled.
"""
from __future__ import annotations

import shutil
import subprocess

PERIOD_MS = 100
QUERY = "utilization.gpu,utilization.decoder"


class GpuSampler:
    """A context manager sampling GPU 0 while its body runs; :attr:`result` afterwards: ``gpu_busy_pct`` and
    ``decoder_busy_pct`` (means over the samples), ``samples``; None without ``nvidia-smi`` or samples."""

    def __init__(self, gpu: int = 0):
        self.gpu = gpu
        self.result: dict | None = None
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> "GpuSampler":
        binary = shutil.which("nvidia-smi")
        if binary is not None:
            self._process = subprocess.Popen(
                [binary, f"--id={self.gpu}", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                 f"--loop-ms={PERIOD_MS}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._process is None:
            return
        self._process.terminate()
        out, _ = self._process.communicate(timeout=10)
        self.result = summarize(out)


def summarize(csv_lines: str) -> dict | None:
    """Means of ``nvidia-smi``'s ``gpu, decoder`` utilization lines (percent); lines that are not two numbers
    (``[N/A]``, a cut last line) are skipped. None when none is left."""
    rows = []
    for line in csv_lines.splitlines():
        try:
            gpu, decoder = (float(v) for v in line.split(","))
        except ValueError:
            continue
        rows.append((gpu, decoder))
    if not rows:
        return None
    return {"gpu_busy_pct": round(sum(r[0] for r in rows) / len(rows), 1),
            "decoder_busy_pct": round(sum(r[1] for r in rows) / len(rows), 1), "samples": len(rows)}
