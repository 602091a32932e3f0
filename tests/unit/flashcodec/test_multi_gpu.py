"""One video's GOP tasks on the NVDEC sessions of several GPUs, without a GPU: the real `NvdecDecoder` scheduling
(threads bound to GPUs, one shared task queue, frames back in order on the output device) on the PyAV stand-in
for NVDEC sessions of fake_nvdec.py, where a GPU id is only a label and frames stay on the CPU."""
import re
import time
from concurrent.futures import Future

import pytest
import torch

from flashcodec import nvdec
from flashcodec.gop import analyse_bitstream
from flashcodec.nvdec import NvdecDecoder
from flashcodec.nvdec_slots import interleave, session_processes
from flashcodec.pipeline import make_decoder
from tests.media import make_video
from tests.unit.flashcodec.fake_nvdec import (H200, UNSUPPORTED, FakeNvcWithDecoder, FakeSession,
                                              assert_cpu_frames, fake_decoder)

LONG = make_video(None, 64, 48, 600, 25, gop=10, bframes=2)  # 60 closed GOPs: 60 tasks of one GOP each
SAMPLED = list(range(0, 600, 3))


def per_gpu(decoder: NvdecDecoder, field: str = "tasks") -> dict[int, int]:
    totals: dict[int, int] = {}
    for stats in decoder.session_stats():
        totals[stats.gpu] = totals.get(stats.gpu, 0) + getattr(stats, field)
    return totals


def test_session_slots_go_round_robin_over_the_gpus():
    assert interleave({0: 2, 1: 2, 2: 2}) == (0, 1, 2, 0, 1, 2)  # thread k on GPU k mod N
    assert interleave({0: 2, 1: 3}) == (0, 1, 0, 1, 1)
    assert interleave({5: 1}) == (5,)


def test_a_long_video_is_spread_over_every_gpu_and_equals_the_one_gpu_result(monkeypatch):
    one = fake_decoder(monkeypatch, 0, max_gop_size=10)
    try:
        single = list(one.decode(LONG, SAMPLED))
    finally:
        one.close()
    decoder = fake_decoder(monkeypatch, [0, 1, 2, 3], 2, max_gop_size=10, window=None)
    try:
        assert decoder.sessions == 8 and decoder.session_gpus == (0, 1, 2, 3, 0, 1, 2, 3) and decoder.window == 16
        frames = list(decoder.decode(LONG, SAMPLED))
        assert len(frames) == len(single) and all(torch.equal(a, b) for a, b in zip(frames, single))
        assert_cpu_frames(frames, LONG, SAMPLED)
        assert decoder.paths.snapshot() == {"nvdec": 1} and not decoder.paths.fallbacks()
        tasks = per_gpu(decoder)
        assert set(tasks) == {0, 1, 2, 3} and all(n > 0 for n in tasks.values()), tasks
        assert sum(tasks.values()) == 60 and sum(per_gpu(decoder, "frames").values()) == len(SAMPLED)
        assert len(decoder.session_stats()) == 8  # every session: 16 tasks queued at once
        for session in FakeSession.made:  # each session on its thread's GPU, thread k on session_gpus[k]
            gpu, k = map(int, re.fullmatch(r"nvdec-gpu(\d+)-(\d+)", session.thread).groups())
            assert session.gpu_id == gpu == decoder.session_gpus[k]
    finally:
        decoder.close()


def test_frames_left_where_they_were_decoded(monkeypatch):
    decoder = fake_decoder(monkeypatch, [0, 1], 1, output_device=None)
    try:
        assert decoder.output_device is None
        assert_cpu_frames(list(decoder.decode(LONG, [0, 299, 599])), LONG, [0, 299, 599])
    finally:
        decoder.close()


class SlowGpu0(FakeSession):
    """GPU 0 takes 5 ms per packet: a GPU busy with other work."""

    def Decode(self, packet):  # noqa: N802
        if self.gpu_id == 0:
            time.sleep(0.005)
        return super().Decode(packet)


class SlowGpu0Nvc(FakeNvcWithDecoder):
    Session = SlowGpu0


def test_a_free_session_on_any_gpu_takes_the_next_task(monkeypatch):
    """One shared queue, not GOP i -> GPU i mod N (30 tasks each here): the fast GPU takes most of them."""
    decoder = fake_decoder(monkeypatch, [0, 1], 1, nvc=SlowGpu0Nvc, max_gop_size=10, window=16)
    try:
        assert_cpu_frames(list(decoder.decode(LONG, SAMPLED)), LONG, SAMPLED)
        tasks = per_gpu(decoder)
        assert sum(tasks.values()) == 60 and tasks[1] >= 3 * tasks[0], tasks
    finally:
        decoder.close()


class FailsOnGpu1(FakeSession):
    def Decode(self, packet):  # noqa: N802
        if self.gpu_id == 1:
            raise RuntimeError("CUDA_ERROR_LAUNCH_FAILED")
        return super().Decode(packet)


class FailsOnGpu1Nvc(FakeNvcWithDecoder):
    Session = FailsOnGpu1


def test_an_nvdec_error_on_one_gpu_sends_the_rest_to_the_cpu(monkeypatch):
    decoder = fake_decoder(monkeypatch, [0, 1], 1, nvc=FailsOnGpu1Nvc, max_gop_size=10)
    try:
        assert_cpu_frames(list(decoder.decode(LONG, SAMPLED)), LONG, SAMPLED)
        assert decoder.paths.snapshot() == {"nvdec": 1, "cpu": 1}
        assert decoder.paths.fallbacks() == {("cpu", "NVDEC failed during decoding"): 1}
        assert "CUDA_ERROR_LAUNCH_FAILED" in decoder.fallbacks[-1][1]
    finally:
        decoder.close()


class MixedNvc(FakeNvcWithDecoder):
    """GPU 0 an H200; GPU 1 with 5 NVDEC engines and no VP9."""

    def GetDecoderCaps(self, *, gpuid, codec, chromaformat, bitdepth):
        caps = super().GetDecoderCaps(gpuid=gpuid, codec=codec, chromaformat=chromaformat, bitdepth=bitdepth)
        if gpuid == 1:
            caps = dict(UNSUPPORTED) if codec.name == "VP9" else {**caps, "num_decoder_engines": 5}
        return caps


def test_sessions_and_support_are_per_gpu(monkeypatch):
    decoder = fake_decoder(monkeypatch, [0, 1], None, nvc=MixedNvc)
    try:
        assert decoder.session_gpus.count(0) == H200[("h264", "420", 8)]["num_decoder_engines"] == 7
        assert decoder.session_gpus.count(1) == 5 and decoder.sessions == 12
        vp9 = analyse_bitstream(make_video(None, 320, 240, 10, 25, codec="libvpx-vp9"))
        assert decoder.why_not(vp9) == "this GPU's NVDEC does not decode vp9 yuv420p"  # any session may get a task
        assert decoder.why_not(analyse_bitstream(LONG)) == ""
    finally:
        decoder.close()
    alone = fake_decoder(monkeypatch, 0, None, nvc=MixedNvc)
    try:
        assert alone.why_not(vp9) == "" and alone.sessions == 7
    finally:
        alone.close()


def test_each_gpus_sessions_are_dealt_over_its_processes():
    assert session_processes((0, 1, 0, 1, 0), 2) == (0, 0, 1, 1, 0)
    assert session_processes((0, 0, 0), 3) == (0, 1, 2)
    assert session_processes((0, 1, 0, 1), 1) == (0, 0, 0, 0)


class InProcessHelper:
    """An NvdecHelper stand-in: runs its jobs on a fake NvdecDecoder of its GPU (so the parent's routing of tasks
    to helpers is tested without a helper process); records what was started."""

    started: list[tuple[int, int]] = []

    def __init__(self, gpu, sessions, max_gop_size):
        InProcessHelper.started.append((gpu, sessions))
        self.inner = NvdecDecoder(gpu, sessions, max_gop_size, output_device="cpu")
        self.alive, self.tasks = True, 0

    def run(self, path, fmt, job, futures, output_device):
        self.tasks += 1
        inner = [Future() for _ in futures]  # the helper's own, as in nvdec_remote.serve
        fed = self.inner.run_job_later(path, fmt, job, inner).result()
        for mine, theirs in zip(futures, inner):
            mine.set_result(theirs.result())
        return fed

    def close(self):
        self.inner.close()


def test_processes_per_gpu_put_each_share_of_sessions_in_a_helper_but_the_output_gpus_first(monkeypatch):
    InProcessHelper.started = []
    monkeypatch.setattr(nvdec, "NvdecHelper", InProcessHelper)
    decoder = fake_decoder(monkeypatch, [0, 1], 4, max_gop_size=10, window=None, helper_processes=True,
                           processes_per_gpu=2, output_device=None)
    try:
        assert decoder.session_gpus == (0, 1) * 4 and decoder.session_procs == (0, 0, 1, 1, 0, 0, 1, 1)
        assert sorted(decoder._helpers) == [(0, 1), (1, 0), (1, 1)]  # (0, 0): this process
        assert sorted(InProcessHelper.started) == [(0, 2), (1, 2), (1, 2)]
        frames = list(decoder.decode(LONG, SAMPLED))
        assert_cpu_frames(frames, LONG, SAMPLED)
        assert all(helper.tasks for helper in decoder._helpers.values()), {k: h.tasks for k, h in decoder._helpers.items()}
        local = sum(s.tasks for s in decoder.session_stats()) - sum(h.tasks for h in decoder._helpers.values())
        assert local > 0  # GPU 0's first share decoded here
    finally:
        decoder.close()


def test_a_helper_that_cannot_start_leaves_its_share_to_this_process(monkeypatch):
    def refuse(gpu, sessions, max_gop_size):
        raise nvdec.HelperError("no NVDEC here")

    monkeypatch.setattr(nvdec, "NvdecHelper", refuse)
    decoder = fake_decoder(monkeypatch, 0, 4, max_gop_size=10, helper_processes=True, processes_per_gpu=2)
    try:
        assert decoder._helpers == {(0, 1): None}
        assert_cpu_frames(list(decoder.decode(LONG, SAMPLED)), LONG, SAMPLED)
        assert decoder.paths.snapshot() == {"nvdec": 1}
    finally:
        decoder.close()


@pytest.mark.parametrize("kwargs", [{"processes_per_gpu": 0, "helper_processes": True}, {"processes_per_gpu": 2}])
def test_bad_processes_per_gpu(monkeypatch, kwargs):
    with pytest.raises(ValueError, match="processes_per_gpu"):
        fake_decoder(monkeypatch, 0, **kwargs)


@pytest.mark.parametrize("gpu_ids", [[], [0, 0]])
def test_bad_gpu_ids(monkeypatch, gpu_ids):
    with pytest.raises(ValueError, match="gpu_ids"):
        fake_decoder(monkeypatch, gpu_ids)


def test_make_decoder_asks_for_all_gpus(monkeypatch):
    """`gpus="all"`: every GPU, the output one first; frames for `device`. Built only (no CUDA to copy to)."""
    monkeypatch.setattr(nvdec, "load_pynvvideocodec", lambda ids: FakeNvcWithDecoder())
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    for gpus, expected in [("all", (1, 0, 2, 3)), (None, (1,)), ([2, 3], (2, 3))]:
        choice = make_decoder("cuda:1", cpu_workers=1, nvdec_sessions=2, gpus=gpus)
        try:
            assert choice.path == "nvdec" and choice.decoder.gpu_ids == expected
            assert choice.decoder.output_device == torch.device("cuda", 1)
            assert choice.decoder.sessions == 2 * len(expected)
        finally:
            choice.close()
    with pytest.raises(ValueError, match="gpus"):
        make_decoder("cuda:0", cpu_workers=1, gpus="every")
    with pytest.raises(ValueError, match="gpu_ids"):
        make_decoder("cuda:0", cpu_workers=1, gpus=[0, 0])


def test_make_decoder_without_nvdec_decodes_on_the_cpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    choice = make_decoder("cuda:0", cpu_workers=1, gpus="all")
    try:
        assert choice.path == "cpu"
    finally:
        choice.close()

