"""Tensors shared between the Triton model processes (KV pool, patch pool).

One process (the owner) allocates a pool once and publishes a handle file in the server's run
directory; other processes map the same memory from that handle. Only page indices then travel
between the stages.

* CPU: the tensor lives in a file under /dev/shm, mapped with ``torch.from_file(shared=True)``.
* CUDA: the tensor is an ordinary device allocation; the handle is torch's CUDA IPC reduction
  (``torch.multiprocessing.reductions.reduce_tensor``), pickled. The owner must outlive every
  mapper (docs/design.md, "Ownership and start-up").

The run directory is ``backends.ipc.run_dir``'s.
"""
from __future__ import annotations

import json
import math
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch

from backends.ipc.run_dir import describe, run_dir


@dataclass
class SharedTensor:
    """A pool tensor and what other processes need to map it."""

    name: str
    tensor: torch.Tensor
    owner: bool
    shm_path: Path | None = None

    def release(self) -> None:
        """Owner only: remove the handle and the /dev/shm file. Mappers just drop the tensor."""
        if not self.owner:
            return
        for suffix in (".json", ".ipc"):
            (run_dir() / f"{self.name}{suffix}").unlink(missing_ok=True)
        if self.shm_path is not None:
            self.shm_path.unlink(missing_ok=True)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _publish(name: str, meta: dict, ipc: bytes | None = None) -> None:
    directory = run_dir()
    if ipc is not None:
        (directory / f"{name}.ipc").write_bytes(ipc)
    tmp = directory / f"{name}.json.tmp"
    tmp.write_text(json.dumps(meta))
    tmp.rename(directory / f"{name}.json")  # the JSON appears last: mappers wait for it


def create(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           extra: dict | None = None) -> SharedTensor:
    """Allocate a zeroed pool of ``shape``/``dtype`` on ``device`` and publish its handle, with ``extra``
    (JSON-serialisable) in its metadata (``describe``).

    Raises RuntimeError when no run directory is set.
    """
    directory = run_dir()
    directory.mkdir(parents=True, exist_ok=True)
    meta = {**(extra or {}), "shape": list(shape), "dtype": _dtype_name(dtype), "device": str(device)}
    if device.type == "cuda":
        from torch.multiprocessing.reductions import reduce_tensor

        tensor = torch.zeros(shape, dtype=dtype, device=device)
        _publish(name, meta, pickle.dumps(reduce_tensor(tensor)))
        return SharedTensor(name, tensor, owner=True)
    shm_path = Path("/dev/shm") / f"unifiedserve-{directory.name}-{name}"
    shm_path.unlink(missing_ok=True)
    flat = torch.from_file(str(shm_path), shared=True, size=math.prod(shape), dtype=dtype)
    flat.zero_()
    _publish(name, {**meta, "path": str(shm_path)})
    return SharedTensor(name, flat.view(shape), owner=True, shm_path=shm_path)


def open_(name: str, timeout_s: float = 120.0) -> SharedTensor:
    """Map the pool ``name`` published by its owner (waits like :func:`describe`)."""
    meta = describe(name, timeout_s)
    if "path" in meta:
        flat = torch.from_file(meta["path"], shared=True, size=math.prod(meta["shape"]), dtype=getattr(torch, meta["dtype"]))
        return SharedTensor(name, flat.view(meta["shape"]), owner=False)
    rebuild, args = pickle.loads((run_dir() / f"{name}.ipc").read_bytes())
    return SharedTensor(name, rebuild(*args), owner=False)
