"""What every stage's ``initialize`` starts with: its parameters and the device it runs on."""
from __future__ import annotations

import logging
import os

import torch

from backends.triton import mps
from backends.triton.triton_io import choice_value

log = logging.getLogger(__name__)


def stage_device(value: str, instance_device_id: int = 0, replica: int = 0) -> torch.device:
    """``"auto"``: the instance's CUDA GPU when there is one (replica k of a stage: GPU ``(id + k) mod GPUs``),
    else the CPU; ``"cpu"``/``"cuda:N"`` as given.

    Raises ValueError for a CUDA device on a machine without one.
    """
    if value in ("", "auto"):
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device(f"cuda:{(instance_device_id + replica) % torch.cuda.device_count()}")
    device = torch.device(value)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={value!r} but this machine has no CUDA GPU")
    return device


def helper_gpus(gpus: str | list[int] | None, own: torch.device) -> list[torch.device]:
    """The GPUs besides ``own`` that a stage's helpers use, from a GPU-set parameter (``triton_io.gpus_value``):
    None -> none; "all" -> every other GPU this process sees; ids -> those ids but ``own``'s. A CPU stage has
    none. Raises ValueError for an id this process does not see."""
    if gpus is None or own.type != "cuda":
        return []
    count = torch.cuda.device_count()
    ids = range(count) if gpus == "all" else gpus
    missing = [g for g in ids if not 0 <= g < count]
    if missing:
        raise ValueError(f"no CUDA GPU {missing[0]} (this process sees {count})")
    return [torch.device("cuda", g) for g in ids if g != (own.index or 0)]


def stage_setup(args: dict) -> tuple[dict[str, str], torch.device]:
    """For a stage's ``initialize(args)``: its config parameters and its device (``device`` parameter,
    see :func:`stage_device`), made this process's current CUDA device when it is a GPU (CUDA-graph capture,
    compiled kernels and flashinfer work on the current device's streams: a stage on GPU 1 capturing while
    GPU 0 is current fails with cudaErrorStreamCaptureInvalidated); also turns on stack dumps to the server log.
    Its ``sm_share`` and ``mps_priority`` (``backends.triton.mps``) are set for CUDA before anything here touches it.
    Raises ValueError for a bad ``sm_share``, ``mps_priority``, ``replica`` or ``device``."""
    from backends.triton import triton_io

    triton_io.enable_stack_dumps()
    params = triton_io.parameters(args)
    share = mps.sm_share(params)
    if share is not None:  # read by CUDA when this process creates its context, i.e. below or later
        os.environ[mps.SHARE_ENV] = str(share)
    priority = mps.mps_priority(params)
    if priority is not None:
        os.environ[mps.PRIORITY_ENV] = mps.PRIORITIES[priority]
    replica = triton_io.int_parameter(params, "replica", 0)
    device = stage_device(params.get("device", "auto"), int(args.get("model_instance_device_id", 0)), replica)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if os.environ.get(mps.PIPE_ENV):  # what the share became: the SMs CUDA shows this MPS client
            log.info("MPS client, sm_share %s: %d SMs of %s, priority %s", f"{share}%" if share else "none",
                     torch.cuda.get_device_properties(device).multi_processor_count, device, priority or "normal")
    return params, device


def shared_weights_on(params: dict[str, str]) -> bool:
    """The ``share_weights`` parameter: on (default: decode publishes its language-model weights and encode_prefill
    maps them instead of holding a copy) or off. Raises ValueError for anything else."""
    return choice_value("share_weights", params.get("share_weights", "on"), "share_weights") == "on"
