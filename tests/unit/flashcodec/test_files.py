"""Media files opened by path (flashcodec/files.py): a regular file reads as usual; a FIFO, a folder or a device is
refused at once, also where a path checked as a regular file was swapped for a FIFO before it was read (a reader
used to block for ever: a fresh user's break test). The image probe refuses it the same way, and so does every
opening of a video by path: the probe, the GOP map, the sequential decoder, a GOP reader (in this process, in a
GOP-parallel worker process, on an NVDEC session thread), which leave no descriptor open."""
import gc
import os
import threading
import warnings
from concurrent.futures import Future

import numpy as np
import pytest

from flashcodec.decoders import CpuDecoder
from flashcodec.errors import MediaError
from flashcodec.files import open_regular, read_regular
from flashcodec.gop import analyse_bitstream, map_for_indices
from flashcodec.gop_plan import plan_gop_tasks
from flashcodec.gop_pool import WorkerPool
from flashcodec.gop_reader import GopJob, GopReader
from flashcodec.nvdec import NvdecError
from flashcodec.nvdec_caps import StreamFormat
from flashcodec.probe import iter_packets, probe_image, probe_video
from tests.media import make_image, make_video
from tests.unit.flashcodec.fake_nvdec import fake_decoder

NOT_REGULAR = "not a regular file (a folder, device or pipe)"


def refused_at_once(call, error: type[Exception] = MediaError, fifo=None, timeout_s: float = 5.0) -> str:
    """The message of the ``error`` that ``call()`` raises, which must come within ``timeout_s`` seconds: a blocked
    reader fails the test instead of hanging the suite (readers blocked on ``fifo`` are let go first, so that the
    test's cleanup does not wait for them)."""
    outcome = {}

    def run():
        try:
            call()
        except error as exc:
            outcome["message"] = str(exc)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    blocked = thread.is_alive()
    if blocked and fifo is not None:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a writer come and gone: its readers read the end
    assert not blocked, "the reader blocked"
    return outcome["message"]


def swap_for_a_fifo(path) -> None:
    """Replace the file at ``path`` by a FIFO, as a rename after the request's check would."""
    fifo = path.with_name(path.name + ".fifo")
    os.mkfifo(fifo)
    os.replace(fifo, path)


def test_a_regular_file_reads_whole_and_blocks_as_usual(tmp_path):
    path = tmp_path / "a.bin"
    path.write_bytes(b"abc" * 1000)
    assert read_regular(path, "image") == b"abc" * 1000
    with open_regular(str(path), "video") as f:
        assert f.read(3) == b"abc" and os.get_blocking(f.fileno())  # O_NONBLOCK cleared


@pytest.mark.parametrize("kind", ["fifo", "folder", "device", "missing"])
def test_what_is_not_a_regular_file_is_refused_at_once(tmp_path, kind):
    path = tmp_path / "x.jpg"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "device":
        path = "/dev/zero"
    message = refused_at_once(lambda: read_regular(path, "image"), fifo=path)
    if kind == "missing":
        assert message == "image: the file cannot be read (No such file or directory)"
    else:
        assert message == f"image: {NOT_REGULAR}"


def test_the_image_probe_refuses_a_path_swapped_for_a_fifo(tmp_path):
    path = tmp_path / "race.jpg"
    path.write_bytes(make_image(64, 48, "RGB", "JPEG"))
    assert (probe_image(str(path)).width, probe_image(path).height) == (64, 48)
    swap_for_a_fifo(path)  # after the request's check, before the probe
    assert refused_at_once(lambda: probe_image(str(path)), fifo=path) == f"image: {NOT_REGULAR}"


def _gop_reader_packets(source) -> list[tuple[int, bytes]]:
    reader = GopReader(source)
    try:
        return [(packet.pts, bytes(packet)) for packet in iter_packets(reader.container)]
    finally:
        reader.close()


VIDEO_OPENERS = {  # each opening of a video, giving what it read in a form that compares
    "probe": probe_video,
    "GOP map": analyse_bitstream,
    "sequential decode": lambda source: np.stack(list(CpuDecoder().decode(source, [0, 5, 9]))).tobytes(),
    "GOP reader": _gop_reader_packets,
}


@pytest.mark.parametrize("open_video", VIDEO_OPENERS.values(), ids=VIDEO_OPENERS)
def test_every_opening_of_a_video_refuses_a_path_swapped_for_a_fifo(tmp_path, open_video):
    path = tmp_path / "race.mp4"
    data = make_video(path, 64, 48, 10, gop=5, bframes=2)
    assert open_video(str(path)) == open_video(path) == open_video(data)  # a regular file reads as its bytes
    swap_for_a_fifo(path)
    assert refused_at_once(lambda: open_video(str(path)), fifo=path) == f"video: {NOT_REGULAR}"


def _video_and_job(path) -> tuple:
    """A video at ``path`` (a Path), its GOP map and the GOP job of its frames 0 and 9 (the map made before any
    swap, as a decoder makes it before its workers read the file)."""
    make_video(path, 64, 48, 10, gop=5, bframes=2)
    indices, bmap = map_for_indices(str(path), [0, 9])
    return bmap, GopJob.of(bmap, plan_gop_tasks(bmap, indices)[0])


def test_a_gop_worker_process_refuses_a_path_swapped_after_the_map(tmp_path):
    path = tmp_path / "race.mp4"
    _, job = _video_and_job(path)
    pool = WorkerPool(1)
    try:
        def run():
            return [future.result(timeout=60) for future in pool.submit(str(path), job, "video")]
        assert sum(len(frames) for frames in run()) == 2
        swap_for_a_fifo(path)
        assert refused_at_once(run, fifo=path) == f"video: {NOT_REGULAR}"
    finally:
        pool.close()


def test_an_nvdec_session_thread_refuses_a_path_swapped_after_the_map(tmp_path, monkeypatch):
    path = tmp_path / "race.mp4"
    bmap, job = _video_and_job(path)
    decoder = fake_decoder(monkeypatch)
    try:
        def run():
            futures = [Future() for _ in job.task.parts]
            decoder.run_job_later(str(path), StreamFormat.of(bmap), job, futures)
            return [future.result(timeout=60) for future in futures]
        assert sum(len(frames) for frames in run()) == 2
        swap_for_a_fifo(path)
        assert refused_at_once(run, NvdecError, path) == f"NVDEC: MediaError: video: {NOT_REGULAR}"
        # a decode whose session failed so goes to the CPU, which refuses the file too (here its GOP map does first)
        assert refused_at_once(lambda: list(decoder.decode(str(path), [0, 9])), fifo=path) == f"video: {NOT_REGULAR}"
    finally:
        decoder.close()


def test_a_video_opened_by_path_leaves_no_descriptor_open(tmp_path):
    path, junk = tmp_path / "clip.mp4", tmp_path / "junk.mp4"
    make_video(path, 64, 48, 10, gop=5)
    junk.write_bytes(b"not a video" * 100)
    before = sorted(os.listdir("/proc/self/fd"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        probe_video(path)
        with pytest.raises(MediaError, match="not a decodable video file"):
            probe_video(junk)
        frames = CpuDecoder().decode(path, [0, 9])
        next(frames)
        frames.close()  # a consumer that stops early
        reader = GopReader(path)
        reader.close()
        assert sorted(os.listdir("/proc/self/fd")) == before  # closed while the reader and the decode are still held
        del reader, frames
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]  # none left to the collector
