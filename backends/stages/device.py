"""Which device a stage runs on (its ``device`` model parameter)."""
from __future__ import annotations

import torch


def stage_device(value: str, instance_device_id: int = 0) -> torch.device:
    """``"auto"``: the instance's CUDA GPU when there is one, else the CPU; ``"cpu"``/``"cuda:N"`` as given.

    Raises ValueError for a CUDA device on a machine without one.
    """
    if value in ("", "auto"):
        return torch.device(f"cuda:{instance_device_id}") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(value)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={value!r} but this machine has no CUDA GPU")
    return device
