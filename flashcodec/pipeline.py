"""Media -> patch rows, one temporal-patch group at a time: decode (decoders), resize + patchify (preprocess)."""
from __future__ import annotations

from typing import Iterator

import torch

from flashcodec.decoders import CpuDecoder, FrameDecoder
from flashcodec.errors import MediaError
from flashcodec.images import load_image
from flashcodec.preprocess import image_patches, video_group_patches
from flashcodec.probe import Source
from flashcodec.sampling import TEMPORAL_PATCH_SIZE, ImagePlan, VideoPlan


def iter_video_groups(
    source: Source, plan: VideoPlan, decoder: FrameDecoder | None = None
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield `(group_index, patches)` for g = 0 .. plan.num_groups - 1 as soon as each group's 2 frames decode.

    `patches`: float32 [plan.patches_per_group, 1176] (see `preprocess.video_group_patches`). Frames are those
    of `plan.frame_indices`, decoded by `decoder` (default `CpuDecoder()`); memory is one group at a time.
    Raises MediaError if the decoder does (undecodable file) or yields fewer frames than planned.
    """
    frames = (decoder or CpuDecoder()).decode(source, plan.frame_indices)
    for group in range(plan.num_groups):
        pair = [frame for _, frame in zip(range(TEMPORAL_PATCH_SIZE), frames)]
        if len(pair) < TEMPORAL_PATCH_SIZE:
            raise MediaError(f"video: truncated: group {group} of {plan.num_groups} has no frames")
        yield group, video_group_patches(pair, plan.resized_height, plan.resized_width)


def image_group(data: bytes, plan: ImagePlan) -> torch.Tensor:
    """Image bytes -> float32 [plan.num_patches, 1176]: `images.load_image`, then `preprocess.image_patches`.

    Raises MediaError for bytes that do not decode to an image.
    """
    return image_patches(load_image(data), plan.resized_height, plan.resized_width)
