"""Where an `NvdecDecoder`'s sessions sit: the GPU and the process of each session slot (thread k of the decoder
serves slot k), and each session's work so far."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


def interleave(sessions: dict[int, int]) -> tuple[int, ...]:
    """The GPU of each session slot, from sessions per GPU: round robin while a GPU has sessions left
    ({0: 2, 1: 3} -> (0, 1, 0, 1, 1)). With equal counts slot k is on GPU k mod N, and the first slots, whose
    threads are made first (as tasks arrive), are on different GPUs, so even a short video uses them all."""
    slots, left = [], dict(sessions)
    while any(left.values()):
        for gpu in sessions:
            if left[gpu]:
                slots.append(gpu)
                left[gpu] -= 1
    return tuple(slots)


def session_processes(session_gpus: Sequence[int], processes_per_gpu: int) -> tuple[int, ...]:
    """The process of each session slot: a GPU's sessions, in slot order, dealt round robin over its
    `processes_per_gpu` processes ((0, 1, 0, 1, 0) with 2 -> (0, 0, 1, 1, 0))."""
    seen: dict[int, int] = {}
    procs = []
    for gpu in session_gpus:
        procs.append(seen.get(gpu, 0) % processes_per_gpu)
        seen[gpu] = seen.get(gpu, 0) + 1
    return tuple(procs)


@dataclass(frozen=True)
class SessionStats:
    """One NVDEC session's work so far: the GPU it decodes on, tasks run, frames returned, packets fed to NVDEC
    (the pictures it decoded), seconds busy (wall clock)."""

    gpu: int
    tasks: int
    frames: int
    packets: int
    busy_s: float
