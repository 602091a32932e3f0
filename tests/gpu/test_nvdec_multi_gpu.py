"""One video on the NVDEC sessions of every GPU (`NvdecDecoder(gpu_ids=all)`, the GPUs past the first in threads
of this process or in helper processes) against the same video on GPU 0 alone: the same frames, in order, on the output GPU (peer-copied there) or left where decoded; every GPU's
sessions decoded some of them; NVDEC itself decoded (no CPU fallback).

Run on a machine with two GPUs or more: `python3 -m pytest -q -s -m gpu tests/gpu/test_nvdec_multi_gpu.py`
(skipped with fewer, or without PyNvVideoCodec).
"""
import time

import pytest
import torch

from flashcodec.decoders import CpuDecoder, DecodePaths
from flashcodec.pipeline import make_decoder
from tests.gpu.test_nvdec import TOLERANCE, mad
from tests.media import make_video

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs or more"),
]
FRAMES = 1400
INDICES = list(range(0, FRAMES, 2))


@pytest.fixture(scope="module")
def video() -> bytes:
    return make_video(None, 640, 360, FRAMES, 25, gop=25, bframes=2)  # 56 closed GOPs: tasks for every GPU


def nvdec_on(gpu_ids, **kwargs):
    pytest.importorskip("PyNvVideoCodec")
    from flashcodec.nvdec import NvdecDecoder

    paths = DecodePaths()
    return NvdecDecoder(gpu_ids, fallback=CpuDecoder(paths=paths), paths=paths, **kwargs)


def decode(decoder, video) -> tuple[list[torch.Tensor], set[torch.device], float]:
    """(frames moved to the host, the devices they came on, seconds) for INDICES, after a warm-up run that opens
    every session; asserts NVDEC itself decoded both runs."""
    list(decoder.decode(video, INDICES))
    start = time.perf_counter()
    frames, devices = [], set()
    for frame in decoder.decode(video, INDICES):
        devices.add(frame.device)
        frames.append(frame.cpu())
    seconds = time.perf_counter() - start
    assert decoder.paths.snapshot() == {"nvdec": 2} and not decoder.paths.fallbacks(), list(decoder.fallbacks)
    return frames, devices, seconds


@pytest.fixture(scope="module")
def one_gpu(video):
    decoder = nvdec_on(0)
    try:
        frames, devices, seconds = decode(decoder, video)
    finally:
        decoder.close()
    assert devices == {torch.device("cuda", 0)}
    return frames, seconds


def assert_same(frames, reference):
    """Equal on GPUs of one model (same decoder and colour conversion); else within TOLERANCE."""
    exact = len({torch.cuda.get_device_name(g) for g in range(torch.cuda.device_count())}) == 1
    assert len(frames) == len(reference) == len(INDICES)
    for index, frame, ref in zip(INDICES, frames, reference):
        assert frame.shape == ref.shape and frame.dtype == torch.uint8
        if exact:
            assert torch.equal(frame, ref), f"frame {index}: {(frame.int() - ref.int()).abs().max()} levels off"
        else:
            error = mad(frame.permute(1, 2, 0).numpy(), ref.permute(1, 2, 0).numpy())
            assert (error <= TOLERANCE).all(), f"frame {index}: MAD per channel {error}"


def assert_every_gpu_worked(decoder, gpus):
    tasks = {g: sum(s.tasks for s in decoder.session_stats() if s.gpu == g) for g in gpus}
    assert all(tasks.values()), f"GPUs without a task: {tasks}"
    print(f"tasks per GPU {tasks}; sessions {decoder.sessions} ({decoder.session_gpus.count(gpus[0])} per GPU)")


@pytest.mark.parametrize("helpers", [False, True], ids=["threads", "helper_processes"])
@pytest.mark.parametrize("output", [0, 1], ids=["on_gpu0", "on_gpu1"])
def test_every_gpu_gives_the_frames_of_one(video, one_gpu, output, helpers):
    gpus = list(range(torch.cuda.device_count()))
    decoder = nvdec_on(gpus, output_device=torch.device("cuda", output), helper_processes=helpers)
    try:
        frames, devices, seconds = decode(decoder, video)
        assert devices == {torch.device("cuda", output)}
        assert_same(frames, one_gpu[0])
        assert_every_gpu_worked(decoder, gpus)
        print(f"{len(INDICES)} frames: 1 GPU {one_gpu[1]:.2f} s, {len(gpus)} GPUs {seconds:.2f} s "
              f"(parallel efficiency {one_gpu[1] / (len(gpus) * seconds):.2f})")
    finally:
        decoder.close()


@pytest.mark.parametrize("helpers", [False, True], ids=["threads", "helper_processes"])
def test_frames_left_on_the_gpu_that_decoded_them(video, one_gpu, helpers):
    gpus = list(range(torch.cuda.device_count()))
    decoder = nvdec_on(gpus, output_device=None, helper_processes=helpers)
    try:
        frames, devices, _ = decode(decoder, video)
        assert devices == {torch.device("cuda", g) for g in gpus}
        assert_same(frames, one_gpu[0])
    finally:
        decoder.close()


def test_make_decoder_on_all_gpus(video, one_gpu):
    pytest.importorskip("PyNvVideoCodec")
    choice = make_decoder("cuda:0", gpus="all")
    try:
        assert choice.path == "nvdec" and choice.decoder.gpu_ids == tuple(range(torch.cuda.device_count()))
        frames = [f.cpu() for f in choice.decoder.decode(video, INDICES)]
        assert choice.paths.snapshot() == {"nvdec": 1} and choice.paths.fallbacks() == {}
        assert_same(frames, one_gpu[0])
        assert_every_gpu_worked(choice.decoder, list(choice.decoder.gpu_ids))
    finally:
        choice.close()


def test_a_helper_that_dies_is_replaced(video, one_gpu):
    gpus = list(range(torch.cuda.device_count()))
    decoder = nvdec_on(gpus, output_device=torch.device("cuda", 0), helper_processes=True)
    try:
        list(decoder.decode(video, INDICES))
        dead = decoder._helpers[(1, 0)]
        dead.process.kill()
        dead.process.wait()
        assert len(list(decoder.decode(video, INDICES))) == len(INDICES)  # what GPU 1 had left: on the CPU
        frames = [f.cpu() for f in decoder.decode(video, INDICES)]
        assert decoder._helpers[(1, 0)] is not dead and decoder._helpers[(1, 0)].alive
        assert_same(frames, one_gpu[0])
        assert_every_gpu_worked(decoder, gpus)
    finally:
        decoder.close()
