"""InternVL3's pixels: an image's tiles and a video frame's one tile, normalised and cut into patch rows.

The reference is transformers 5.17's `GotOcr2ImageProcessor.crop_image_to_patches` / `_preprocess`
(`models/got_ocr2/image_processing_got_ocr2.py`, `crop_to_patches=True`) and `InternVLVideoProcessor._preprocess`
(`models/internvl/video_processing_internvl.py`): bicubic antialiased resizes of uint8 pixels (torchvision v2's
`resize`, here `flashcodec.preprocess.resize_frames`: the same torch op on the CPU, so no torchvision is needed),
then rescale and normalise fused in float32 with ImageNet's mean/std. On the CPU the values are bit-identical
(tests/unit/flashcodec/test_internvl3_pixels.py).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
from PIL import Image

from flashcodec.families.internvl3 import InternVL3Config, SegmentVideoPlan, TiledImagePlan
from flashcodec.preprocess import frames_tensor, image_tensor, normalize, resize_frames


def tile_rows(tiles: torch.Tensor, patch_size: int) -> torch.Tensor:
    """float32 [N, 3, S, S] tiles -> [N * (S/p)**2, 3*p*p] patch rows: tile by tile, patches in raster order, each
    row's values (C, p, p). What the tower's stride-p patch convolution reads (`InternVLVisionPatchEmbeddings`): it
    equals `torch.nn.functional.unfold(tiles, p, stride=p).transpose(1, 2)`, and the conv is a matmul on these rows.
    """
    n, c, s, _ = tiles.shape
    g = s // patch_size
    patches = tiles.reshape(n, c, g, patch_size, g, patch_size)
    return patches.permute(0, 2, 4, 1, 3, 5).reshape(n * g * g, c * patch_size * patch_size)


def tiles_from_rows(rows: torch.Tensor, tiles: int, channels: int, patch_size: int) -> torch.Tensor:
    """`tile_rows` undone: float [tiles * g * g, channels * p * p] patch rows (g patches a side) -> a new
    [tiles, channels, g * p, g * p] tensor (transformers' `pixel_values`), on the rows' device. What the encode stage
    does to a group read from the patch pool, the one conversion between the pool's rows and the tower's tiles.
    Raises ValueError when the rows are not whole square tiles of that patch size.
    """
    width = channels * patch_size * patch_size
    per_tile = rows.shape[0] // tiles if rows.dim() == 2 and tiles > 0 else 0
    g = math.isqrt(per_tile)
    if rows.dim() != 2 or rows.shape[1] != width or not g or g * g * tiles != rows.shape[0]:
        raise ValueError(f"patch rows {list(rows.shape)} are not {tiles} square tiles of [{channels}, {patch_size}, "
                         f"{patch_size}] patches ({width} values a row)")
    patches = rows.reshape(tiles, g, g, channels, patch_size, patch_size)
    return patches.permute(0, 3, 1, 4, 2, 5).reshape(tiles, channels, g * patch_size, g * patch_size)


def image_tiles(pixels: torch.Tensor, plan: TiledImagePlan, config: InternVL3Config,
                device: torch.device | str | None = None) -> torch.Tensor:
    """uint8 [1, 3, H, W] -> float32 [plan.num_groups, 3, S, S] (S = `plan.tile_size`): the image resized to
    `plan.columns` x `plan.rows` tiles and cut row by row, then its thumbnail (the whole image resized to one tile)
    when `plan.thumbnail`. `crop_image_to_patches`, then `rescale_and_normalize` (the per-tile resize to S x S that
    `_preprocess` runs next leaves S x S tiles as they are), normalised on `device` (None: the pixels' own; resized
    where the pixels are). Raises ValueError for pixels of another shape.
    """
    if pixels.ndim != 4 or pixels.shape[:2] != (1, 3) or pixels.dtype != torch.uint8:
        raise ValueError(f"image_tiles wants uint8 [1, 3, H, W], got {pixels.dtype} {list(pixels.shape)}")
    s = plan.tile_size
    canvas = resize_frames(pixels, plan.rows * s, plan.columns * s)[0]
    tiles = canvas.view(3, plan.rows, s, plan.columns, s).permute(1, 3, 0, 2, 4).reshape(-1, 3, s, s)
    if plan.thumbnail:
        tiles = torch.cat([tiles, resize_frames(pixels, s, s)])
    return normalize(tiles.to(device), config.mean, config.std)


def image_rows(image: Image.Image, plan: TiledImagePlan, config: InternVL3Config,
               device: torch.device | str | None = None) -> torch.Tensor:
    """An RGB Pillow image (`flashcodec.images.load_image`) -> float32 [plan.num_groups * plan.patches_per_group,
    3 * 14 * 14] on `device` (None: the CPU): `image_tiles` as `tile_rows`. Raises ValueError for a non-RGB image."""
    return tile_rows(image_tiles(image_tensor(image), plan, config, device), config.patch_size)


def frame_rows(frames: Sequence[np.ndarray | torch.Tensor], plan: SegmentVideoPlan,
               config: InternVL3Config) -> torch.Tensor:
    """One decoded frame (HxWx3 uint8 numpy, or 3xHxW uint8 on a device) -> float32 [plan.patches_per_group,
    3 * 14 * 14] on its device: resized to one tile, normalised, as `tile_rows`. `InternVLVideoProcessor`'s resize
    to `size` (448 x 448) and fused normalisation. Raises ValueError for other than one frame of that shape and dtype.
    """
    if len(frames) != 1:
        raise ValueError(f"an InternVL3 video group is 1 frame, got {len(frames)}")
    tile = resize_frames(frames_tensor(frames), plan.tile_size, plan.tile_size)
    return tile_rows(normalize(tile, config.mean, config.std), config.patch_size)
