"""The FlashCodec stage without Triton: a group's patch pages are taken once it is decoded, the stage waits
while the pool is full (back-pressure), and an abort stops that wait."""
from __future__ import annotations

import queue

import pytest
import torch

from backends.ipc.run_dir import RUN_DIR_ENV
from backends.stages.flashcodec_worker import FlashCodecWorker
from flashcodec.patch_pool import pages_needed, read_group
from flashcodec.pipeline import iter_video_groups
from flashcodec.probe import probe_video
from flashcodec.sampling import plan_video
from tests.media import make_video

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
    worker = FlashCodecWorker(torch.device("cpu"), num_pages=3, page_size=PAGE, threads=2)
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
