"""Qwen2.5-VL's sampling and sizing rules: how many frames, which ones, what size, how many patches and tokens.

The arithmetic is qwen-vl-utils 0.0.14's (`vision_process.py`: `smart_resize`, `smart_nframes`, `fetch_video`,
`fetch_image`), reproduced exactly where it is defined; the deviations (C1, C3, C6 in shared/cases) are marked.
Everything here is computed from metadata, before any decoding.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from typing import ClassVar

from flashcodec.errors import MediaError
from flashcodec.probe import ImageInfo, VideoInfo

PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
FACTOR = PATCH_SIZE * MERGE_SIZE  # 28: a resized side is a multiple of this
PATCH_DIM = 3 * TEMPORAL_PATCH_SIZE * PATCH_SIZE * PATCH_SIZE  # 1176 values per patch row
MAX_RATIO = 200
IMAGE_MIN_PIXELS = 4 * FACTOR * FACTOR  # IMAGE_MIN_TOKEN_NUM * 28 * 28
IMAGE_MAX_PIXELS = 16384 * FACTOR * FACTOR  # IMAGE_MAX_TOKEN_NUM * 28 * 28
VIDEO_MIN_PIXELS = 128 * FACTOR * FACTOR  # VIDEO_MIN_TOKEN_NUM * 28 * 28, per frame
VIDEO_MAX_PIXELS = 768 * FACTOR * FACTOR  # VIDEO_MAX_TOKEN_NUM * 28 * 28, per frame
VIDEO_TOTAL_PIXELS = 128000 * FACTOR * FACTOR * 0.9  # MODEL_SEQ_LEN * 28 * 28 * 0.9, all frames together
FRAME_FACTOR = 2
FPS = 2.0
FPS_MIN_FRAMES = 4
FPS_MAX_FRAMES = 768


def round_by_factor(number: float, factor: int) -> int:
    return round(number / factor) * factor


def ceil_by_factor(number: float, factor: int) -> int:
    return math.ceil(number / factor) * factor


def floor_by_factor(number: float, factor: int) -> int:
    return math.floor(number / factor) * factor


def smart_resize(
    height: int, width: int, factor: int = FACTOR, min_pixels: float | None = None, max_pixels: float | None = None
) -> tuple[int, int]:
    """(h, w) in pixels: multiples of `factor`, area within [min_pixels, max_pixels], aspect ratio kept.

    qwen-vl-utils `smart_resize`, defaults IMAGE_MIN_PIXELS / IMAGE_MAX_PIXELS. One deviation (case C1): where a
    max_pixels downscale would floor a side to 0, it is kept at `factor`, as transformers' `smart_resize` does.
    Raises MediaError if max/min side > MAX_RATIO (200), ValueError if the sizes or pixel bounds are invalid.
    """
    max_pixels = IMAGE_MAX_PIXELS if max_pixels is None else max_pixels
    min_pixels = IMAGE_MIN_PIXELS if min_pixels is None else min_pixels
    if height < 1 or width < 1:
        raise ValueError(f"smart_resize: height and width must be >= 1, got {height}x{width}")
    if not 0 < min_pixels <= max_pixels:
        raise ValueError(f"min_pixels ({min_pixels}) must be > 0 and <= max_pixels ({max_pixels})")
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise MediaError(
            f"aspect ratio {max(height, width) / min(height, width):.1f} of {width}x{height} exceeds the limit of "
            f"{MAX_RATIO} (Qwen2.5-VL MAX_RATIO)"
        )
    h_bar = max(factor, round_by_factor(height, factor))
    w_bar = max(factor, round_by_factor(width, factor))
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, floor_by_factor(height / beta, factor))
        w_bar = max(factor, floor_by_factor(width / beta, factor))
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = ceil_by_factor(height * beta, factor)
        w_bar = ceil_by_factor(width * beta, factor)
    return h_bar, w_bar


def smart_nframes(
    total_frames: int,
    video_fps: float,
    fps: float = FPS,
    min_frames: int = FPS_MIN_FRAMES,
    max_frames: int = FPS_MAX_FRAMES,
) -> int:
    """Number of frames to sample: `total_frames / video_fps * fps`, clamped to [min_frames, max_frames] and to
    `total_frames`, floored to a multiple of FRAME_FACTOR.

    qwen-vl-utils `smart_nframes` (the `fps` branch, `max_frames` capped by `total_frames`). Raises ValueError,
    as it does, when the result is outside [FRAME_FACTOR, total_frames] (a clip of fewer than 2 frames).
    """
    min_frames = ceil_by_factor(min_frames, FRAME_FACTOR)
    max_frames = floor_by_factor(min(max_frames, total_frames), FRAME_FACTOR)
    nframes = total_frames / video_fps * fps
    nframes = floor_by_factor(min(min(max(nframes, min_frames), max_frames), total_frames), FRAME_FACTOR)
    if not FRAME_FACTOR <= nframes <= total_frames:
        raise ValueError(f"nframes should in interval [{FRAME_FACTOR}, {total_frames}], but got {nframes}.")
    return nframes


@dataclass(frozen=True)
class VideoPlan:
    """Which frames of a video to decode and how they become patches.

    `frame_indices`: presentation-order frame indices, non-decreasing, len = 2 * `num_groups`.
    `frame_times_s`: their presentation times (seconds from the first frame). `resized_height`/`resized_width`:
    pixels per frame after resize. `grid_thw`: (t, h, w) in 14-px patches, t = frames / 2. `sampled_fps`:
    frames per second of the sample (qwen-vl-utils `sample_fps`); `second_per_grid_t` = 2 / sampled_fps is what
    M-RoPE advances per temporal group. A group holds `patches_per_group` rows of 1176 values and becomes
    `tokens_per_group` LLM tokens after the 2x2 merge.
    """

    frame_indices: tuple[int, ...]
    frame_times_s: tuple[float, ...]
    resized_height: int
    resized_width: int
    grid_thw: tuple[int, int, int]
    sampled_fps: float
    second_per_grid_t: float
    num_groups: int
    patches_per_group: int
    tokens_per_group: int
    family: ClassVar[str] = "qwen2_5_vl"
    kind: ClassVar[str] = "video"


@dataclass(frozen=True)
class ImagePlan:
    """An image's resize target (pixels), `grid_thw` = (1, h/14, w/14), patch rows and LLM tokens: one group."""

    resized_height: int
    resized_width: int
    grid_thw: tuple[int, int, int]
    num_patches: int
    num_tokens: int
    family: ClassVar[str] = "qwen2_5_vl"
    kind: ClassVar[str] = "image"
    num_groups: ClassVar[int] = 1

    @property
    def patches_per_group(self) -> int:
        return self.num_patches

    @property
    def tokens_per_group(self) -> int:
        return self.num_tokens


def _check_pixels(min_pixels: int | None, max_pixels: int | None) -> None:
    for key, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{key} must be a positive integer, got {value!r}")


def _indices_by_time(info: VideoInfo, nframes: int) -> list[int]:
    """Case C6: frame k is the one on screen at `k * duration / nframes`, so samples are evenly spaced in time."""
    start = info.frame_pts_s[0]
    step = info.duration_s / nframes
    # a micro-second slack absorbs time-base rounding of the timestamps
    return [max(0, bisect_right(info.frame_pts_s, start + k * step + 1e-6) - 1) for k in range(nframes)]


def plan_video(
    info: VideoInfo, fps: float = FPS, max_pixels: int | None = None, min_pixels: int | None = None
) -> VideoPlan:
    """Sample and size a video like qwen-vl-utils `fetch_video` (its decord/torchcodec readers), from metadata.

    Constant frame rate: `nframes = smart_nframes(info.num_frames, info.fps, fps)` and indices
    `torch.linspace(0, num_frames - 1, nframes).round()`, exactly. Variable frame rate (`info.variable_frame_rate`,
    case C6): the same count with `video_fps = num_frames / duration_s`, taken evenly in presentation time.
    A 1-frame clip (case C3, where qwen-vl-utils raises) gives that frame twice, as its frame-list path pads with
    the last frame. Per-frame pixel cap: `max(min(VIDEO_MAX_PIXELS, VIDEO_TOTAL_PIXELS / nframes * 2),
    int(min_pixels * 1.05))`, lowered (never raised) by `max_pixels`; `min_pixels` defaults to VIDEO_MIN_PIXELS.
    Raises ValueError naming `fps`, `min_pixels` or `max_pixels` when invalid (`max_pixels` below `min_pixels`
    included); MediaError for an aspect ratio over 200 or a video without frames.
    """
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps) or fps <= 0:
        raise ValueError(f"fps must be a positive finite number, got {fps!r}")
    _check_pixels(min_pixels, max_pixels)
    total = info.num_frames
    if total < 1:
        raise MediaError("video: no frames")
    video_fps = total / info.duration_s if info.variable_frame_rate else info.fps
    if total == 1:
        indices = [0, 0]
    else:
        nframes = smart_nframes(total, video_fps, fps)
        if info.variable_frame_rate:
            indices = _indices_by_time(info, nframes)
        else:
            import torch  # qwen-vl-utils' own call, for its exact float32 rounding; kept out of module imports

            indices = torch.linspace(0, total - 1, nframes).round().long().tolist()
    nframes = len(indices)
    sampled_fps = nframes / total * video_fps
    min_px = VIDEO_MIN_PIXELS if min_pixels is None else min_pixels
    if max_pixels is not None and max_pixels < min_px:
        # Requests set max_pixels only, so the message is about max_pixels, not smart_resize's min <= max.
        floor = "Qwen2.5-VL's per-frame minimum, 128*28*28" if min_pixels is None else "min_pixels"
        raise ValueError(f"max_pixels must be at least {min_px} for a video ({floor}), got {max_pixels}")
    cap = max(min(VIDEO_MAX_PIXELS, VIDEO_TOTAL_PIXELS / nframes * FRAME_FACTOR), int(min_px * 1.05))
    max_px = cap if max_pixels is None else min(max_pixels, cap)
    try:
        h, w = smart_resize(info.height, info.width, FACTOR, min_pixels=min_px, max_pixels=max_px)
    except MediaError as exc:
        raise MediaError(f"video: {exc}") from exc
    grid = (nframes // TEMPORAL_PATCH_SIZE, h // PATCH_SIZE, w // PATCH_SIZE)
    start = info.frame_pts_s[0]
    return VideoPlan(
        frame_indices=tuple(indices),
        frame_times_s=tuple(info.frame_pts_s[i] - start for i in indices),
        resized_height=h,
        resized_width=w,
        grid_thw=grid,
        sampled_fps=sampled_fps,
        second_per_grid_t=TEMPORAL_PATCH_SIZE / sampled_fps,
        num_groups=grid[0],
        patches_per_group=grid[1] * grid[2],
        tokens_per_group=grid[1] * grid[2] // (MERGE_SIZE * MERGE_SIZE),
    )


def plan_image(info: ImageInfo, max_pixels: int | None = None, min_pixels: int | None = None) -> ImagePlan:
    """Size an image like qwen-vl-utils `fetch_image`: `smart_resize` with IMAGE_MIN/MAX_PIXELS defaults.

    Images under 28 px are scaled up to `min_pixels` (case C1). Raises MediaError naming the aspect limit (200),
    ValueError naming `min_pixels`/`max_pixels` when they are invalid or min > max.
    """
    _check_pixels(min_pixels, max_pixels)
    try:
        h, w = smart_resize(info.height, info.width, FACTOR, min_pixels=min_pixels, max_pixels=max_pixels)
    except MediaError as exc:
        raise MediaError(f"image: {exc}") from exc
    grid = (1, h // PATCH_SIZE, w // PATCH_SIZE)
    return ImagePlan(
        resized_height=h,
        resized_width=w,
        grid_thw=grid,
        num_patches=grid[1] * grid[2],
        num_tokens=grid[1] * grid[2] // (MERGE_SIZE * MERGE_SIZE),
    )
