"""Decode tasks from a GOP map and the sampled frames: which packets to decode, on how many decoders, in what order.

Pure Python on `gop.BitstreamMap` (no PyAV, no torch), shared by the GOP-parallel CPU decoder and NVDEC.

* Only GOPs holding a sampled frame are decoded, each from its keyframe up to the packet (decode order) of its
  last sampled frame; the rest of the GOP is never fed to a decoder.
* Open GOPs: a sampled *leading* frame (shown before its GOP's keyframe) references the previous GOP, so that
  GOP is decoded whole in the same task, straight into the next one (exact, at the cost of one more GOP).
  When no leading frame is sampled, decoding starts at the open GOP's keyframe and its leading frames, which
  then decode wrongly, are never returned.
* Dynamic GOP regrouping: consecutive needed GOPs are packed into tasks of at most
  `min(max_gop_size, ceil(total / workers))` decoded packets, so every decoder gets work and short GOPs do not
  each pay a task's overhead.
* Long GOPs: every frame of a GOP depends on its keyframe, so a GOP is never split across decoders; a split
  part on another decoder would redo the whole prefix (a GOP of n parts would cost n(n+1)/2 parts of work)
  for no gain in latency, since that prefix takes as long to decode as on the first decoder. Instead a task
  longer than `max_gop_size` packets returns its frames in parts, each at most `max_gop_size` decoded packets
  after the previous one, so its first groups stream out after at most `max_gop_size` packets of work and the
  decoder's progress deadline is per part. Each packet is decoded at most once.
* Tasks are in presentation order: dispatched first-come first-served they finish roughly in order, and the
  consumer waits only for the next part it needs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from flashcodec.gop import BitstreamMap

MAX_GOP_SIZE = 256  # decoded packets (frames) per task or task part


@dataclass(frozen=True)
class Segment:
    """Packets `first_packet` .. `last_packet` (decode order, inclusive) decoded in one run from a keyframe."""

    first_packet: int
    last_packet: int

    @property
    def num_packets(self) -> int:
        return self.last_packet - self.first_packet + 1


@dataclass(frozen=True)
class TaskPart:
    """Frames a task hands back together: `frames` (presentation indices, increasing, unique), complete once
    every packet up to `until_packet` (decode order) has been decoded."""

    frames: tuple[int, ...]
    until_packet: int


@dataclass(frozen=True)
class DecodeTask:
    """Work for one decoder session: `segments` decoded in order (each starts at a GOP's keyframe; the decoder is
    drained and reset between segments), returning `parts` in order. `cost`: packets decoded."""

    index: int
    segments: tuple[Segment, ...]
    parts: tuple[TaskPart, ...]

    @property
    def cost(self) -> int:
        return sum(s.num_packets for s in self.segments)

    @property
    def frames(self) -> tuple[int, ...]:
        return tuple(f for part in self.parts for f in part.frames)


def _needed_until(bmap: BitstreamMap, targets: list[int]) -> tuple[dict[int, int], set[int]]:
    """(GOP index -> last packet (decode order) to decode in it, GOPs whose sampled leading frames need the
    previous GOP decoded whole right before them). The previous GOPs are included in the first."""
    until: dict[int, int] = {}
    linked: set[int] = set()
    for frame in targets:
        packet = bmap.frame_packet[frame]
        gop = bmap.gops[bmap.packet_gop[packet]]
        until[gop.index] = max(until.get(gop.index, -1), packet)
        if frame < gop.key_frame and gop.index > 0:  # a leading frame: the previous GOP is its reference
            linked.add(gop.index)
    for index in linked:
        until[index - 1] = bmap.gops[index - 1].last_packet
    return dict(sorted(until.items())), linked


def _units(until: dict[int, int], linked: set[int]) -> list[list[int]]:
    """Needed GOPs in runs that must stay on one decoder: a GOP decoded whole, then the open GOP whose sampled
    leading frames reference it."""
    units: list[list[int]] = []
    for index in until:
        if index in linked:
            units[-1].append(index)  # index - 1 is in `until`, so it ended the previous unit
        else:
            units.append([index])
    return units


def _segments(bmap: BitstreamMap, gops: list[int], until: dict[int, int]) -> tuple[Segment, ...]:
    segments: list[Segment] = []
    for index in gops:
        first = bmap.gops[index].first_packet
        if segments and segments[-1].last_packet + 1 == first:  # the previous GOP was decoded whole: go on
            segments[-1] = Segment(segments[-1].first_packet, until[index])
        else:
            segments.append(Segment(first, until[index]))
    return tuple(segments)


def _parts(bmap: BitstreamMap, segments: tuple[Segment, ...], frames: list[int], max_gop_size: int):
    """Split a task's frames (presentation order) so each part needs at most `max_gop_size` decoded packets
    beyond the previous part."""
    offsets, done = {}, 0  # segment start packet -> decoded packets before it in this task
    for segment in segments:
        offsets[segment.first_packet] = done
        done += segment.num_packets

    def position(packet: int) -> int:  # decoded packets up to and including `packet`
        start = max(s for s in offsets if s <= packet)
        return offsets[start] + packet - start + 1

    parts: list[TaskPart] = []
    current: list[int] = []
    reached, until = 0, -1  # decoded packets the previous parts need; last packet the current part needs
    for frame in frames:
        packet = bmap.frame_packet[frame]
        if current and position(max(until, packet)) - reached > max_gop_size:
            parts.append(TaskPart(tuple(current), until))
            reached, current = position(until), []
        current.append(frame)
        until = max(until, packet)
    parts.append(TaskPart(tuple(current), until))
    return tuple(parts)


def plan_gop_tasks(
    bmap: BitstreamMap, frame_indices: Sequence[int], max_gop_size: int = MAX_GOP_SIZE, workers: int = 1
) -> tuple[DecodeTask, ...]:
    """Decode tasks that return every frame of `frame_indices` (presentation indices, as `sampling.plan_video`
    gives; repeats allowed) once, ordered by their first frame.

    `max_gop_size`: decoded packets per task (several short GOPs) or per part of a task (a GOP longer than it).
    `workers`: decoders that will share the tasks; tasks are made small enough for each to get one.
    Raises ValueError for `max_gop_size` or `workers` < 1 or a frame index outside [0, info.num_frames).
    """
    if max_gop_size < 1 or workers < 1:
        raise ValueError(f"max_gop_size and workers must be >= 1, got {max_gop_size}, {workers}")
    targets = sorted(set(frame_indices))
    if targets and not 0 <= targets[0] <= targets[-1] < bmap.info.num_frames:
        raise ValueError(f"frame indices must be in [0, {bmap.info.num_frames}), got {targets[0]}..{targets[-1]}")
    until, linked = _needed_until(bmap, targets)
    units = _units(until, linked)
    cost = {index: last - bmap.gops[index].first_packet + 1 for index, last in until.items()}
    total = sum(cost.values())
    limit = max(1, min(max_gop_size, math.ceil(total / workers)))
    groups: list[list[int]] = []
    load = 0
    for unit in units:
        unit_cost = sum(cost[i] for i in unit)
        if groups and load + unit_cost <= limit:
            groups[-1].extend(unit)
            load += unit_cost
        else:
            groups.append(list(unit))
            load = unit_cost
    frames_of = {index: [] for index in until}
    for frame in targets:
        frames_of[bmap.packet_gop[bmap.frame_packet[frame]]].append(frame)
    tasks = []
    for gops in groups:
        segments = _segments(bmap, gops, until)
        frames = sorted(f for index in gops for f in frames_of[index])
        tasks.append((frames[0], segments, _parts(bmap, segments, frames, max_gop_size)))
    tasks.sort(key=lambda t: t[0])
    return tuple(DecodeTask(i, segments, parts) for i, (_, segments, parts) in enumerate(tasks))
