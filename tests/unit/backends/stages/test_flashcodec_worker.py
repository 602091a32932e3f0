"""The FlashCodec stage without Triton: a group's patch pages are taken once it is decoded, the stage waits
while the pool is full (back-pressure), and an abort stops that wait; its decode threads are shared fairly
between requests, and aborts and failures give them back."""
from __future__ import annotations

import os
import queue
import threading

import pytest
import torch

from backends.ipc.protocol import INVALID_INPUT, SERVER_FAULT
from backends.ipc.run_dir import RUN_DIR_ENV
from backends.stages.flashcodec_worker import FlashCodecWorker
from flashcodec.patch_pool import pages_needed, read_group
from flashcodec.pipeline import iter_video_groups
from flashcodec.probe import probe_image, probe_video
from flashcodec.sampling import plan_image, plan_video
from tests.media import make_image, make_video

PAGE = 256


@pytest.fixture
def video():
    data = make_video(None, 320, 240, 60, 10)
    plan = plan_video(probe_video(data))
    assert plan.num_groups == 6 and pages_needed(plan.patches_per_group, PAGE) == 3
    return data, plan


@pytest.fixture
def worker(tmp_path, monkeypatch):
    """A pool of 3 pages: exactly one group of the video."""
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "run"))
    worker = FlashCodecWorker(torch.device("cpu"), num_pages=3, page_size=PAGE, threads=2, patch_dim=1176)
    yield worker
    worker.shutdown()


def start(worker, data, plan, request_id="r1"):
    groups, done = queue.Queue(), queue.Queue()
    worker.submit(request_id, data, plan, lambda g, pages: groups.put((g, pages)), done.put)
    return groups, done


def test_each_group_waits_for_the_pages_of_the_one_before(worker, video):
    data, plan = video
    expected = [patches for _, patches in iter_video_groups(data, plan)]
    groups, done = start(worker, data, plan)
    for index in range(plan.num_groups):
        g, pages = groups.get(timeout=30)
        assert g == index and len(pages) == 3 and worker.free_pages.num_free == 0
        assert torch.equal(read_group(worker.pool.tensor, pages, plan.patches_per_group), expected[index])
        if index + 1 < plan.num_groups:
            with pytest.raises(queue.Empty):  # the next group is decoded but has no pages: it waits
                groups.get(timeout=0.3)
        worker.free_pages.free(pages)  # as the orchestrator does once the group is encoded
    assert done.get(timeout=30) is None
    assert worker.free_pages.num_free == 3 and groups.empty()


def test_an_abort_stops_the_wait_for_pages(worker, video):
    data, plan = video
    groups, done = start(worker, data, plan)
    _, pages = groups.get(timeout=30)
    worker.abort("r1")
    assert done.get(timeout=10) is None and groups.empty()
    assert worker.free_pages.num_free == 0  # the reported group's pages are the caller's to free
    worker.free_pages.free(pages)
    assert worker.free_pages.num_free == 3 and not worker.running and not worker.cancelled


def test_a_server_stop_ends_every_decode(worker, video):
    """A decode waiting for pages and one not yet started both end (the final callback, as after an
    abort), so that their streams close and the model can unload; the pages they did not report go back."""
    data, plan = video
    groups, done = start(worker, data, plan)
    _, pages = groups.get(timeout=30)
    later_groups, later = start(worker, data, plan, request_id="r2")  # waits for pages behind r1
    worker.stop()
    assert done.get(timeout=10) is None and later.get(timeout=30) is None
    assert groups.empty() and later_groups.empty()
    worker.free_pages.free(pages)
    assert worker.free_pages.num_free == 3 and not worker.running


def test_gpu_set_parameters():
    from backends.triton.triton_io import gpus_value

    assert gpus_value("nvdec_gpus", "own") is None and gpus_value("k", "") is None and gpus_value("k", " ALL ") == "all"
    assert gpus_value("k", "1,0") == [1, 0]
    for bad in ("0,0", "-1", "gpu1", "1,,2"):
        with pytest.raises(ValueError, match="parameter nvdec_gpus must be"):
            gpus_value("nvdec_gpus", bad)


class HeldItems:
    """Image items on a worker of 2 threads (16 pages) whose decode threads stay busy after reporting their group
    until ``release(name)``: the order in which items start is then the fair queue's alone."""

    def __init__(self, worker: FlashCodecWorker):
        self.worker = worker
        self.data = make_image(64, 64, "RGB", "PNG")
        self.plan = plan_image(probe_image(self.data))
        self.started: queue.Queue = queue.Queue()  # names, as each item reports its group
        self.gates: dict[str, threading.Event] = {}
        self.ends: dict[str, queue.Queue] = {}

    def submit(self, request_id: str, name: str, data: bytes | None = None, hold: bool = True) -> None:
        gate = self.gates[name] = threading.Event()
        if not hold:
            gate.set()

        def on_group(index: int, pages: list[int]) -> None:
            self.worker.free_pages.free(pages)  # as the orchestrator does once the group is encoded
            self.started.put(name)
            assert gate.wait(30)

        self.ends[name] = queue.Queue()
        self.worker.submit(request_id, data or self.data, self.plan, on_group, self.ends[name].put)

    def next_started(self) -> str:
        return self.started.get(timeout=30)

    def release(self, name: str):
        """Let ``name``'s thread go; returns its final callback's argument."""
        self.gates[name].set()
        return self.ends[name].get(timeout=30)


@pytest.fixture
def held(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "run"))
    worker = FlashCodecWorker(torch.device("cpu"), num_pages=16, page_size=PAGE, threads=2, patch_dim=1176)
    items = HeldItems(worker)
    yield items
    for gate in items.gates.values():  # a failed test leaves no thread waiting
        gate.set()
    worker.shutdown()


def test_a_request_of_many_items_leaves_the_next_free_thread_to_another(held):
    for i in range(6):
        held.submit("big", f"big{i}")
    assert {held.next_started(), held.next_started()} == {"big0", "big1"}  # a lone request uses both threads
    held.submit("small", "small", hold=False)
    assert held.started.empty()  # both threads busy: running items are not interrupted
    assert held.release("big0") is None
    assert held.next_started() == "small"  # the freed thread, ahead of big2..big5 queued before it
    assert held.ends["small"].get(timeout=30) is None
    assert held.next_started() == "big2"
    for i in range(1, 6):  # one thread frees at a time: one request's items start in order
        assert held.release(f"big{i}") is None
        if i + 2 < 6:
            assert held.next_started() == f"big{i + 2}"
    assert held.worker.queue.busy == 0 and not held.worker.running and held.worker.free_pages.num_free == 16


def test_an_abort_drops_the_queued_items_and_frees_every_thread(held):
    for i in range(5):
        held.submit("r1", f"r1-{i}")
    assert {held.next_started(), held.next_started()} == {"r1-0", "r1-1"}
    held.worker.abort("r1")
    for i in range(2, 5):  # ended at once, never decoded, while the running two still hold their threads
        assert held.ends[f"r1-{i}"].get(timeout=5) is None
    assert held.started.empty() and len(held.worker.queue) == 0 and held.worker.queue.busy == 2
    assert held.release("r1-0") is None and held.release("r1-1") is None
    assert held.worker.queue.busy == 0 and not held.worker.running and not held.worker.cancelled
    held.submit("r1", "again", hold=False)  # the abort mark is spent: the same id decodes again
    assert held.next_started() == "again" and held.ends["again"].get(timeout=30) is None


def test_failed_items_give_their_thread_back(held):
    """A file that does not decode (invalid_input), a report that cannot be sent (server_fault: the pages go
    back): each ends its stream with the failure, and the items queued behind them still run."""
    def lost(index, pages):
        raise ConnectionError("the orchestrator has gone")

    held.submit("r1", "bad", data=b"not an image", hold=False)
    ends = queue.Queue()
    held.worker.submit("r1", held.data, held.plan, lost, ends.put)
    for i in range(3):
        held.submit("r1", f"ok{i}", hold=False)
    assert held.ends["bad"].get(timeout=30).kind == INVALID_INPUT
    assert ends.get(timeout=30).kind == SERVER_FAULT
    assert all(held.ends[f"ok{i}"].get(timeout=30) is None for i in range(3))
    assert held.worker.queue.busy == 0 and not held.worker.running and held.worker.free_pages.num_free == 16


def _drain(groups, done, worker):
    """Free each reported group's pages, as the orchestrator does, until the item ends; returns its final
    callback's argument."""
    while done.empty() or not groups.empty():
        try:
            worker.free_pages.free(groups.get(timeout=0.1)[1])
        except queue.Empty:
            pass
    return done.get()


@pytest.mark.parametrize("when", ["unchanged", "before the decode", "while it decodes", "removed"])
def test_a_video_file_replaced_after_its_check_fails_its_request_saying_so(worker, video, tmp_path, when):
    """The orchestrator planned the request from the file it checked (``stamp``); a file renamed over it (or
    removed) before or while the item is decoded fails the request naming that, not with another file's frames or
    a misleading "frame index past the last frame"."""
    from flashcodec.files import file_stamp

    data, plan = video
    path, other = tmp_path / "clip.mp4", tmp_path / "other.mp4"
    path.write_bytes(data)
    other.write_bytes(make_video(None, 320, 240, 20, 10))  # fewer frames than the plan samples
    stamp = file_stamp(path.stat())
    if when == "before the decode":
        os.replace(other, path)
    elif when == "removed":
        path.unlink()
    groups, done = queue.Queue(), queue.Queue()
    worker.submit("r1", str(path), plan, lambda g, pages: groups.put((g, pages)), done.put, stamp)
    if when == "while it decodes":
        worker.free_pages.free(groups.get(timeout=30)[1])  # the first group is out; the second waits for pages
        os.replace(other, path)
    failure = _drain(groups, done, worker)
    if when == "unchanged":
        assert failure is None
    else:
        assert failure.kind == INVALID_INPUT
        assert failure.message == ("video: the file cannot be read any more (No such file or directory): it was "
                                   "removed while the request ran" if when == "removed" else
                                   "video: the file changed while the request ran (replaced or rewritten after it "
                                   "was checked): send the request again once it is written")
    assert worker.free_pages.num_free == 3 and not worker.running


def test_a_decoder_fault_on_a_file_changed_since_its_check_is_the_clients(worker, video, tmp_path, monkeypatch):
    """An exception other than a media error (an OSError of the file's own read, say) is a server fault, unless the
    file changed under the decoder: then the request's input is at fault, told as the change."""
    from backends.stages import flashcodec_worker
    from flashcodec.files import file_stamp

    data, plan = video
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    stamp = file_stamp(path.stat())

    calls = []

    def failing(*args):
        if not calls:
            path.write_bytes(data[: len(data) // 2])  # truncated while it is read
        calls.append(args)
        raise OSError(22, "Invalid argument")
        yield

    monkeypatch.setattr(flashcodec_worker, "iter_video_groups", failing)
    groups, done = queue.Queue(), queue.Queue()
    worker.submit("r1", str(path), plan, lambda g, pages: groups.put((g, pages)), done.put, stamp)
    failure = done.get(timeout=30)
    assert (failure.kind, failure.message) == (INVALID_INPUT, "video: the file changed while the request ran "
                                               "(replaced or rewritten after it was checked): send the request "
                                               "again once it is written")
    worker.submit("r2", str(path), plan, lambda g, pages: groups.put((g, pages)), done.put, file_stamp(path.stat()))
    assert done.get(timeout=30).kind == SERVER_FAULT  # the same fault on an unchanged file
