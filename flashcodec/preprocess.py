"""Resize, normalise and patchify: pixels in, patch rows out (Qwen2.5-VL's temporal-patch groups of 1176 values;
resize, normalise and the frame/image conversions are shared with `flashcodec.families.internvl3_pixels`).

The reference is transformers' Qwen2_5_VLProcessor components, `Qwen2VLVideoProcessor(cap_pixels_per_frame=True)`
and `Qwen2VLImageProcessor` (torchvision backend): the same torch ops in the same order, so the values are
bit-identical on CPU (tests/unit/flashcodec/test_preprocess.py measures it).
"""
from __future__ import annotations

import functools
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from flashcodec.sampling import FACTOR, MERGE_SIZE, PATCH_DIM, PATCH_SIZE, TEMPORAL_PATCH_SIZE

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # transformers.utils.constants
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
RESCALE_FACTOR = 1 / 255


@functools.lru_cache(maxsize=8)
def _fused(mean: tuple[float, ...], std: tuple[float, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers fuses rescale into normalize: mean and std scaled by 1 / rescale_factor, in float32
    (`TorchvisionBackend._fuse_mean_std_and_rescale_factor`)."""
    return (torch.tensor(mean, device=device).mul(1.0 / RESCALE_FACTOR).view(-1, 1, 1),
            torch.tensor(std, device=device).mul(1.0 / RESCALE_FACTOR).view(-1, 1, 1))


def resize_frames(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Bicubic, antialiased resize of uint8 frames [N, 3, H, W] to [N, 3, height, width] uint8.

    torchvision.transforms.v2's `resize` on tensors, what the transformers processors call: native uint8
    interpolation on CPU, `resize_frames_float` on other devices.
    """
    if frames.shape[-2:] == (height, width):
        return frames
    if frames.device.type == "cpu":
        return F.interpolate(frames, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
    return resize_frames_float(frames, height, width)


def resize_frames_float(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """`resize_frames` computed in float32, clamped and rounded back to uint8 [N, 3, height, width].

    torchvision's uint8 path on CUDA, and on every device in torchvision.transforms.functional (v1), which
    qwen-vl-utils `fetch_video` calls. On CPU it differs from the native uint8 path by a few levels (the test
    measures it).
    """
    out = F.interpolate(frames.float(), size=(height, width), mode="bicubic", align_corners=False, antialias=True)
    return out.clamp_(0, 255).round_().to(torch.uint8)


def normalize(frames: torch.Tensor, mean: tuple[float, ...] = OPENAI_CLIP_MEAN,
              std: tuple[float, ...] = OPENAI_CLIP_STD) -> torch.Tensor:
    """uint8 [N, 3, H, W] -> float32 `(x / 255 - mean) / std` (per channel), fused as transformers'
    `TorchvisionBackend.rescale_and_normalize` does. Defaults: the CLIP mean/std of Qwen2.5-VL."""
    fused_mean, fused_std = _fused(tuple(mean), tuple(std), frames.device)
    return frames.to(torch.float32).sub(fused_mean).div_(fused_std)


def frames_tensor(frames: Sequence[np.ndarray | torch.Tensor]) -> torch.Tensor:
    """Decoded frames of one size -> uint8 [N, 3, H, W]: HxWx3 numpy frames (CPU decoders) or 3xHxW tensors (NVDEC,
    on their device). Raises ValueError for frames of another shape or dtype, or of different sizes."""
    if frames and all(isinstance(f, torch.Tensor) for f in frames):
        if any(f.dtype != torch.uint8 or f.ndim != 3 or f.shape[0] != 3 or f.shape != frames[0].shape for f in frames):
            shapes = [(tuple(f.shape), f.dtype) for f in frames]
            raise ValueError(f"frames must be 3xHxW uint8 of one size, got {shapes}")
        return torch.stack(list(frames))
    if any(not isinstance(f, np.ndarray) or f.dtype != np.uint8 or f.ndim != 3 or f.shape[2] != 3
           or f.shape != frames[0].shape for f in frames):
        raise ValueError("frames must be HxWx3 uint8 of one size, got "
                         f"{[(getattr(f, 'shape', None), str(getattr(f, 'dtype', type(f)))) for f in frames]}")
    return torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2)


def image_tensor(img: Image.Image) -> torch.Tensor:
    """An RGB Pillow image -> uint8 [1, 3, H, W], the values of torchvision's `pil_to_tensor` (what transformers'
    processors call). Raises ValueError if `img` is not RGB (see `flashcodec.images.load_image`)."""
    if img.mode != "RGB":
        raise ValueError(f"want an RGB image, got mode {img.mode}")
    return torch.from_numpy(np.array(img)).permute(2, 0, 1).unsqueeze(0)


def patchify_group(frames: torch.Tensor) -> torch.Tensor:
    """float32 [2, 3, h, w] (one temporal patch, h and w multiples of 28) -> [(h/14) * (w/14), 1176].

    Row order (h/28, w/28, 2, 2): each 2x2 block of patches that the merger turns into one LLM token is
    contiguous. Values within a row are ordered (C, T=2, 14, 14). `Qwen2VLVideoProcessor.patchify` with grid_t = 1.
    """
    t, c, h, w = frames.shape
    if t != TEMPORAL_PATCH_SIZE or c != 3 or h % FACTOR or w % FACTOR:
        raise ValueError(f"patchify_group: want [2, 3, h, w] with h, w multiples of {FACTOR}, got {list(frames.shape)}")
    gh, gw = h // PATCH_SIZE, w // PATCH_SIZE
    m, p = MERGE_SIZE, PATCH_SIZE
    patches = frames.reshape(t, c, gh // m, m, p, gw // m, m, p)  # a view, also of an expanded image: one copy below
    # (h/28, w/28, merge_h, merge_w, C, T, 14, 14)
    return patches.permute(2, 5, 3, 6, 1, 0, 4, 7).reshape(gh * gw, PATCH_DIM)


def _check_size(height: int, width: int) -> None:
    if height < FACTOR or width < FACTOR or height % FACTOR or width % FACTOR:
        raise ValueError(f"resized size must be positive multiples of {FACTOR}, got {height}x{width}")


def video_group_patches(frames: Sequence[np.ndarray | torch.Tensor], resized_h: int, resized_w: int) -> torch.Tensor:
    """Two decoded frames (see `frames_tensor`) -> float32 [(resized_h/14) * (resized_w/14), 1176], on their device.

    Raises ValueError for a wrong number, shape or dtype of frames, or a size that is not a multiple of 28.
    """
    _check_size(resized_h, resized_w)
    if len(frames) != TEMPORAL_PATCH_SIZE:
        raise ValueError(f"a temporal-patch group is {TEMPORAL_PATCH_SIZE} frames, got {len(frames)}")
    return patchify_group(normalize(resize_frames(frames_tensor(frames), resized_h, resized_w)))


def image_patches(img: Image.Image, resized_h: int, resized_w: int,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """An RGB image -> float32 [(resized_h/14) * (resized_w/14), 1176] on `device` (None: the CPU): one group, the
    image twice in time.

    `Qwen2VLImageProcessor.patchify` repeats the image over the temporal patch of 2; resized once here, on the CPU
    (the reference's uint8 path), then normalised and cut on `device`: a GPU gets the resized uint8 pixels (a 1280x720
    image: 2.8 MB) instead of the float32 rows (22 MB), and the same values (subtraction, IEEE division and a
    permutation). Raises ValueError if `img` is not RGB (see `flashcodec.images.load_image`) or the size is not a
    multiple of 28.
    """
    _check_size(resized_h, resized_w)
    frame = normalize(resize_frames(image_tensor(img), resized_h, resized_w).to(device))
    return patchify_group(frame.expand(TEMPORAL_PATCH_SIZE, -1, -1, -1))  # the repeat is written once, by the cut
