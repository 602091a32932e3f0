"""Decode tasks from a GOP map and the sampled frames: which packets to decode, on how many decoders, in what
order; and the frames of finished tasks back in order (`frames_in_order`).

Pure Python on `gop.BitstreamMap` (no PyAV, no torch), shared by the GOP-parallel CPU decoder and NVDEC.

* Only GOPs holding a sampled frame are decoded, each from its keyframe up to the packet (decode order) of its
  last sampled frame; the rest of the GOP is never fed to a decoder, nor are disposable packets (pictures no
  other picture references, `gop.BitstreamMap.packet_disposable`) that are not sampled themselves.
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
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from flashcodec.errors import MediaError
from flashcodec.gop import BitstreamMap

MAX_GOP_SIZE = 256  # decoded packets (frames) per task or task part


@dataclass(frozen=True)
class Segment:
    """Packets `first_packet` .. `last_packet` (decode order, inclusive) read in one run from a keyframe; all
    are decoded but `skip` (disposable, not sampled), which a decoder that can choose its packets leaves out."""

    first_packet: int
    last_packet: int
    skip: frozenset[int] = frozenset()

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
    drained and reset between segments), returning `parts` in order. `cost`: packets decoded, skipped ones not
    counted; `num_packets`: packets read."""

    index: int
    segments: tuple[Segment, ...]
    parts: tuple[TaskPart, ...]

    @property
    def cost(self) -> int:
        return sum(s.num_packets - len(s.skip) for s in self.segments)

    @property
    def num_packets(self) -> int:
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


def _segments(bmap: BitstreamMap, gops: list[int], until: dict[int, int], sampled: set[int]) -> tuple[Segment, ...]:
    """Decode runs of `gops`; `sampled`: packets of sampled frames (never skipped)."""
    runs: list[list[int]] = []
    for index in gops:
        first = bmap.gops[index].first_packet
        if runs and runs[-1][1] + 1 == first:  # the previous GOP was decoded whole: go on
            runs[-1][1] = until[index]
        else:
            runs.append([first, until[index]])
    disposable = bmap.packet_disposable
    return tuple(
        Segment(a, b, frozenset(p for p in range(a, b + 1) if disposable[p] and p not in sampled)) for a, b in runs)


def _group(units: list[list[int]], cost: dict[int, int], limit: int) -> list[list[int]]:
    """Pack consecutive units into groups of at most `limit` cost (a unit over it alone), first fit in order."""
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
    return groups


def _parts(bmap: BitstreamMap, segments: tuple[Segment, ...], frames: list[int], max_gop_size: int):
    """Split a task's frames (presentation order) so each part needs at most `max_gop_size` packets read
    beyond the previous part (skipped packets count: the bound holds for decoded ones a fortiori)."""
    offsets, done = {}, 0  # segment start packet -> packets read before it in this task
    for segment in segments:
        offsets[segment.first_packet] = done
        done += segment.num_packets

    def position(packet: int) -> int:  # packets read up to and including `packet`
        start = max(s for s in offsets if s <= packet)
        return offsets[start] + packet - start + 1

    parts: list[TaskPart] = []
    current: list[int] = []
    reached, until = 0, -1  # packets the previous parts need; last packet the current part needs
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
    sampled = {bmap.frame_packet[f] for f in targets}
    fed = [not d for d in bmap.packet_disposable]
    cost = {i: sum(fed[p] or p in sampled for p in range(bmap.gops[i].first_packet, end + 1))
            for i, end in until.items()}
    limit = max(1, min(max_gop_size, math.ceil(sum(cost.values()) / workers)))
    groups = _group(_units(until, linked), cost, limit)
    frames_of = {index: [] for index in until}
    for frame in targets:
        frames_of[bmap.packet_gop[bmap.frame_packet[frame]]].append(frame)
    tasks = []
    for gops in groups:
        segments = _segments(bmap, gops, until, sampled)
        frames = sorted(f for index in gops for f in frames_of[index])
        tasks.append((frames[0], segments, _parts(bmap, segments, frames, max_gop_size)))
    tasks.sort(key=lambda t: t[0])
    return tuple(DecodeTask(i, segments, parts) for i, (_, segments, parts) in enumerate(tasks))


def frames_in_order(
    tasks: Sequence[DecodeTask],
    frame_indices: Sequence[int],
    submit: Callable[[DecodeTask], list[Future]],
    window: int,
) -> Iterator:
    """Yield the frame of each entry of `frame_indices` in order, from `tasks` run by `submit`.

    `submit(task)` starts a task and returns one Future per part, resolving to that part's frames in
    `part.frames` order (None for a frame that did not decode). At most `window` tasks, counting the one being
    read, are submitted at a time, which bounds the decoded frames held in memory. A frame that did not decode is
    replaced by the nearest decoded frame before it (after it if there is none), as `CpuDecoder` does. On
    exit (end, error, or the consumer closing the generator) the futures not yet started are cancelled.
    Raises what a part's future raises, and MediaError if no frame decodes at all.
    """
    owner = {f: (task.index, p, k)
             for task in tasks for p, part in enumerate(task.parts) for k, f in enumerate(part.frames)}
    futures: dict[int, list[Future]] = {}
    submitted, previous, waiting = 0, None, 0  # waiting: lost frames seen before any decoded one
    try:
        for frame in frame_indices:
            t, p, k = owner[frame]
            while submitted < min(len(tasks), t + window):
                futures[submitted] = submit(tasks[submitted])
                submitted += 1
            for done in [i for i in futures if i < t]:
                del futures[done]  # consumed: let its frames go
            decoded = futures[t][p].result()[k]
            if decoded is None and previous is None:
                waiting += 1
                continue
            for _ in range(waiting):
                yield decoded
            waiting, previous = 0, decoded if decoded is not None else previous
            yield previous
        if waiting:
            raise MediaError("video: corrupt: no frame could be decoded")
    finally:
        for parts in futures.values():
            for future in parts:
                future.cancel()
