"""Data-parallel vision encoding: one step's images and temporal-patch groups spread over copies of the vision
tower on several devices (issue 5; the paper runs Qwen2.5-VL's small tower data parallel).

Every item is encoded whole by one tower (the tower attends within an image or a temporal group, so an item
never needs another device), and the items are dealt out largest first to the least loaded tower, load counted
in patch rows. Each tower runs its items on its own thread, in order; the embeddings come back on the model's
device in the order of the items. The copies are made from the prepared tower (varlen attention, padded MLP)
and compiled the same way. The first call runs its items one after the other on the caller's thread: dynamo
compiles on first use, and a thread compiling while another runs compiled code fails ("Detected that you are
using FX to symbolically trace a dynamo-optimized function" with a cold compile cache); with dynamic shapes the
later calls find compiled code. Large towers (InternVL's 6B) are split over GPUs instead:
``backends.runtime.vision.tensor_parallel``.
"""
from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import torch
from torch import nn

from backends.runtime.vision.batch import Item


def deal(rows: Sequence[int], towers: int) -> list[list[int]]:
    """Item indices per tower: largest first to the least loaded (patch rows), ties to the lowest tower.
    Each tower's list is in item order."""
    load, plan = [0] * towers, [[] for _ in range(towers)]
    for item in sorted(range(len(rows)), key=lambda i: (-rows[i], i)):
        tower = min(range(towers), key=lambda t: (load[t], t))
        load[tower] += rows[item]
        plan[tower].append(item)
    return [sorted(items) for items in plan]


class VisionReplicas:
    """``visual`` (on the model's device) plus a copy on each of ``devices``.

    ``prepare(tower)`` is applied to each copy once it is on its device (e.g. ``torch.compile`` of its blocks); each
    tower runs its share of a call's items in one forward, ``encode(tower, items)`` (the family's ``encode_batch``).
    Raises ValueError when a GPU would hold two towers.
    """

    def __init__(self, visual: nn.Module, devices: Sequence[torch.device], prepare: Callable[[nn.Module], None],
                 encode: Callable[[nn.Module, Sequence[Item]], list[torch.Tensor]]):
        own = next(visual.parameters()).device
        all_devices = [own, *(torch.device(d) for d in devices)]
        gpus = [str(d) for d in all_devices if d.type == "cuda"]
        if len(set(gpus)) != len(gpus):  # CPU towers may repeat: the CPU tests run two there
            raise ValueError(f"one vision tower per GPU, got {[str(d) for d in all_devices]}")
        self.devices, self._encode = all_devices, encode
        self.towers = [visual] + [copy.deepcopy(visual).to(d) for d in all_devices[1:]]
        for tower in self.towers[1:]:
            prepare(tower)
        self._executor = ThreadPoolExecutor(len(self.towers), thread_name_prefix="vision")
        self._warm = False  # every tower has run once (compiled)

    def encode_many(self, items: Sequence[Item], out_device: torch.device) -> list[torch.Tensor]:
        """Embeddings of each item (in order) on ``out_device``; items spread by :func:`deal`."""
        plan = deal([int(p.shape[0]) for p, _ in items], len(self.towers))
        results: list[torch.Tensor | None] = [None] * len(items)
        if not self._warm:  # every tower in turn, on this thread (one without items runs the first, to compile)
            for t, indices in enumerate(plan):
                for index, embeds in zip(indices, self._run(t, [items[i] for i in indices] or items[:1], out_device)):
                    results[index] = embeds
            self._warm = bool(items)
            return results
        futures = [self._executor.submit(self._run, t, [items[i] for i in indices], out_device)
                   for t, indices in enumerate(plan) if indices]
        for future, indices in zip(futures, [p for p in plan if p]):
            for index, embeds in zip(indices, future.result()):
                results[index] = embeds
        return results

    def _run(self, t: int, items: list[Item], out_device: torch.device) -> list[torch.Tensor]:
        tower, device = self.towers[t], self.devices[t]
        out = [e.to(out_device, non_blocking=True) for e in self._encode(tower, items)]  # patches moved to the tower
        for used in {device, torch.device(out_device)}:  # the caller reads these on another thread
            if used.type == "cuda":
                torch.cuda.current_stream(used).synchronize()
        return out

    def close(self) -> None:
        self._executor.shutdown(wait=True)
