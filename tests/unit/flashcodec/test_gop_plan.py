"""plan_gop_tasks: only needed GOPs, bounded task sizes, open-GOP dependencies, order; frames_in_order."""
from concurrent.futures import Future
from fractions import Fraction

import pytest

from flashcodec.errors import MediaError
from flashcodec.gop import BitstreamMap, Gop, analyse_bitstream
from flashcodec.gop_plan import frames_in_order, plan_gop_tasks
from flashcodec.probe import VideoInfo
from flashcodec.sampling import plan_video
from tests.unit.flashcodec.test_gop import encode


def synthetic_map(sizes: list[int], leading: int = 0, disposable: int = 0) -> BitstreamMap:
    """GOPs of `sizes` frames at 25 fps; GOPs after the first are open with `leading` leading frames: their
    keyframe is decoded first, then the frames shown before it, then the rest (decode order). With
    `disposable` = n, every n-th packet that is not a keyframe is disposable."""
    pts, gops, start = [], [], 0
    for index, size in enumerate(sizes):
        lead = leading if index and size > leading else 0
        order = [start + lead] + list(range(start, start + lead)) + list(range(start + lead + 1, start + size))
        gops.append(Gop(index, len(pts), size, -1, -1, 0, start / 25, (start + size - 1) / 25, start, start + lead,
                        bool(lead)))
        pts += order
        start += size
    frame_packet = sorted(range(len(pts)), key=pts.__getitem__)
    info = VideoInfo(64, 48, 64, 48, 0, 25.0, len(pts), len(pts) / 25, "h264", tuple(i / 25 for i in range(len(pts))),
                     False)
    keys = {g.first_packet for g in gops}
    dropped = tuple(bool(disposable) and p not in keys and p % disposable == 0 for p in range(len(pts)))
    return BitstreamMap(info, "High", "yuv420p", 8, Fraction(1, 25), tuple(gops), tuple(pts), tuple(pts),
                        tuple(g.index for g in gops for _ in range(g.num_frames)), tuple(frame_packet), dropped,
                        True)


def decoded_packets(task) -> set[int]:
    return {p for s in task.segments for p in range(s.first_packet, s.last_packet + 1) if p not in s.skip}


def check_plan(bmap, indices, max_gop_size=256, workers=1):
    tasks = plan_gop_tasks(bmap, indices, max_gop_size, workers)
    # every sampled frame exactly once, tasks and parts in presentation order
    assert [f for t in tasks for f in t.frames] == sorted(set(indices))
    assert [t.index for t in tasks] == list(range(len(tasks)))
    for task in tasks:
        packets = decoded_packets(task)
        assert len(packets) == task.cost <= task.num_packets
        skipped = {p for s in task.segments for p in s.skip}
        assert all(bmap.packet_disposable[p] for p in skipped)
        assert not skipped & {bmap.frame_packet[f] for f in task.frames}
        for segment in task.segments:  # decoding starts at keyframes
            assert bmap.gops[bmap.packet_gop[segment.first_packet]].first_packet == segment.first_packet
        for part in task.parts:
            assert all(bmap.frame_packet[f] <= part.until_packet for f in part.frames)
            assert all(bmap.frame_packet[f] in packets for f in part.frames)
        # each needed packet range of a GOP starts at its keyframe and stops at its last needed packet
        assert max(bmap.frame_packet[f] for f in task.frames) == max(packets)
    return tasks


def test_only_gops_with_sampled_frames_and_only_up_to_the_last_one():
    bmap = synthetic_map([30] * 10)
    tasks = check_plan(bmap, [5, 6, 95, 250])
    needed = set().union(*(decoded_packets(t) for t in tasks))
    assert needed == set(range(0, 7)) | set(range(90, 96)) | set(range(240, 251))


def test_short_gops_are_grouped_into_balanced_tasks():
    bmap = synthetic_map([12] * 100)
    indices = list(range(0, 1200, 3))  # each GOP decoded up to frame 9 of 12: 10 packets, 1000 in all
    for workers, limit in ((1, 256), (4, 250), (16, 63)):  # min(max_gop_size, ceil(1000 / workers))
        tasks = check_plan(bmap, indices, 256, workers)
        costs = [t.cost for t in tasks]
        assert max(costs) <= limit and len(tasks) >= workers
        assert min(costs[:-1]) > limit - 10  # greedy packing: each full task is within one GOP of the limit
        assert all(len(t.parts) == 1 for t in tasks)


def test_a_long_gop_streams_out_in_parts_and_is_decoded_once():
    bmap = synthetic_map([10_000])
    tasks = check_plan(bmap, list(range(0, 10_000, 25)), max_gop_size=256, workers=8)
    (task,) = tasks  # one GOP cannot be spread over decoders: every frame needs its keyframe
    assert task.cost == 9_976 and len(task.parts) >= 9_976 / 256
    positions = [p.until_packet + 1 for p in task.parts]
    assert all(b - a <= 256 for a, b in zip([0] + positions, positions))


def test_disposable_packets_are_skipped_unless_sampled():
    bmap = synthetic_map([30] * 2, disposable=3)
    (task,) = check_plan(bmap, [3, 6, 29, 40])  # packets 3 and 6 are disposable but sampled
    (segment,) = task.segments  # GOP 0 is decoded whole, so GOP 1 follows on
    assert (segment.first_packet, segment.last_packet) == (0, 40)
    assert segment.skip == set(range(9, 28, 3)) | {33, 36, 39} and task.cost == 41 - 10


def test_a_sampled_leading_frame_takes_the_previous_gop_along():
    bmap = synthetic_map([20, 20, 20], leading=2)
    (task,) = check_plan(bmap, [40], workers=3)  # frame 40 is GOP 2's first leading frame
    assert [(s.first_packet, s.last_packet) for s in task.segments] == [(20, 41)]
    (task,) = check_plan(bmap, [42], workers=3)  # GOP 2's keyframe: no need for GOP 1
    assert [(s.first_packet, s.last_packet) for s in task.segments] == [(40, 40)]


def test_open_gops_of_a_real_stream():
    bmap = analyse_bitstream(encode("libx265", None, frames=60, gop=12))
    assert any(g.open for g in bmap.gops)
    assert len(check_plan(bmap, list(range(60)), workers=4)) >= 2
    check_plan(bmap, plan_video(bmap.info).frame_indices, workers=4)


@pytest.mark.parametrize("args", [dict(max_gop_size=0), dict(workers=0), dict(indices=[300])])
def test_bad_arguments(args):
    indices = args.pop("indices", [0])
    with pytest.raises(ValueError):
        plan_gop_tasks(synthetic_map([30] * 10), indices, **args)


def done(value) -> Future:
    future = Future()
    future.set_result(value)
    return future


def test_frames_in_order_fills_lost_frames_and_bounds_the_window():
    bmap = synthetic_map([4] * 6)
    tasks = plan_gop_tasks(bmap, list(range(24)), max_gop_size=4, workers=6)
    submitted = []

    def submit(task):
        submitted.append(task.index)
        return [done([None if f in (0, 1, 9) else f for f in part.frames]) for part in task.parts]

    frames = frames_in_order(tasks, [0, 1, 2, 2, 9, 10, 23], submit, window=2)
    assert next(frames) == 2 and submitted == [0, 1]  # lost frames 0, 1 take the first decoded one after
    # lost frame 9 takes the one yielded before it (a decoder fills a lost frame from its own task first)
    assert list(frames) == [2, 2, 2, 2, 10, 23]
    with pytest.raises(MediaError, match="no frame"):
        list(frames_in_order(tasks[:1], [0, 1], lambda t: [done([None] * len(p.frames)) for p in t.parts], 2))


def test_frames_in_order_cancels_unstarted_work_on_exit():
    tasks = plan_gop_tasks(synthetic_map([4] * 6), list(range(24)), max_gop_size=4, workers=6)
    futures = {}

    def submit(task):
        futures[task.index] = [Future() for _ in task.parts]
        if task.index == 0:
            futures[0][0].set_exception(MediaError("video: corrupt"))
        return futures[task.index]

    with pytest.raises(MediaError, match="corrupt"):
        list(frames_in_order(tasks, list(range(24)), submit, window=3))
    assert sorted(futures) == [0, 1, 2] and all(f.cancelled() for i in (1, 2) for f in futures[i])
