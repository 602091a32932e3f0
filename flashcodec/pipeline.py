"""Media -> patch rows, one group at a time: decode (decoders), then the plan's family (resize, normalise, patchify).

`make_decoder` picks the video decoder for a stage: NVDEC on a GPU when PyNvVideoCodec works there, else the
GOP-parallel CPU decoder, else the sequential CPU decoder.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from flashcodec.decoders import CpuDecoder, DecodePaths, FrameDecoder
from flashcodec.errors import MediaError
from flashcodec.families import MediaPlan, family_of
from flashcodec.gop_plan import MAX_GOP_SIZE
from flashcodec.gop_pool import PoolUnavailable
from flashcodec.images import load_image
from flashcodec.nvdec import NvdecDecoder, NvdecUnavailable
from flashcodec.parallel import ParallelCpuDecoder
from flashcodec.probe import Source

log = logging.getLogger(__name__)


def iter_video_groups(
    source: Source, plan: MediaPlan, decoder: FrameDecoder | None = None
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield `(group_index, patches)` for g = 0 .. plan.num_groups - 1 as soon as each group's frames decode.

    `plan` is a family's video plan (`flashcodec.families`): its family says how many frames make a group
    (Qwen2.5-VL 2, InternVL3 1) and how they become patch rows. `patches`: float32 [plan.patches_per_group,
    family.patch_dim], on the device of the decoder's frames: the CPU for numpy frames, the GPU for a GPU decoder's
    3xHxW tensors (resized and normalised there). Frames are those of `plan.frame_indices`, decoded by `decoder`
    (default `CpuDecoder()`); memory is one group at a time. Raises MediaError if the decoder does (undecodable
    file) or yields fewer frames than planned.
    """
    family = family_of(plan)
    frames = (decoder or CpuDecoder()).decode(source, plan.frame_indices)
    for group in range(plan.num_groups):
        batch = [frame for _, frame in zip(range(family.frames_per_group), frames)]
        if len(batch) < family.frames_per_group:
            raise MediaError(f"video: truncated: group {group} of {plan.num_groups} has no frames")
        yield group, family.video_group(batch, plan)


def iter_image_groups(data: bytes, plan: MediaPlan,
                      device: torch.device | str | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield `(group_index, patches)` of an image: float32 [plan.patches_per_group, family.patch_dim] per group
    (Qwen2.5-VL: one group; InternVL3: one per tile, the thumbnail last) on `device` (None: the CPU):
    `images.load_image`, then the family's `image_groups`. Raises MediaError for bytes that do not decode to an image.
    """
    return family_of(plan).image_groups(load_image(data), plan, device)


def image_group(data: bytes, plan: MediaPlan) -> torch.Tensor:
    """Every group of `iter_image_groups`, concatenated in group order: float32 [plan.num_groups *
    plan.patches_per_group, family.patch_dim]. Raises as it does."""
    return torch.cat([rows for _, rows in iter_image_groups(data, plan)])


@dataclass(frozen=True)
class DecoderChoice:
    """The decoder a stage uses (`path`: "nvdec", "cpu_parallel" or "cpu") and `paths`, the per-video counts of
    the path that really decoded (fallbacks included), to expose as a metric. `close()` stops its processes."""

    decoder: FrameDecoder
    path: str
    paths: DecodePaths

    def close(self) -> None:
        close = getattr(self.decoder, "close", None)
        if close is not None:
            close()


def make_decoder(
    device: torch.device | str = "auto",
    cpu_workers: int | None = None,
    nvdec_sessions: int | None = None,
    max_gop_size: int = MAX_GOP_SIZE,
    part_timeout_s: float = 60.0,
    gpus: Sequence[int] | str | None = None,
    helper_processes: bool = True,
    processes_per_gpu: int = 1,
) -> DecoderChoice:
    """The best video decoder available for `device` ("auto": the first GPU if there is one, else the CPU).

    On a CUDA device: `nvdec.NvdecDecoder` with `nvdec_sessions` sessions per GPU (default one per NVDEC engine)
    on the GPUs `gpus`: None (default) `device`'s GPU alone; "all" every GPU this process sees (`device`'s first);
    or a list of GPU ids. Frames always end on `device` (where they are patchified and encoded), peer-copied
    there from the GPU that decoded them; `helper_processes`: GPUs besides `device`'s decode in helper processes
    (`NvdecDecoder`'s option: one process feeding several GPUs is bound by its GIL), each GPU's sessions split over
    `processes_per_gpu` processes (`device`'s first share in this one). NVDEC falls back per video
    to the CPU decoder below. CPU:
    `parallel.ParallelCpuDecoder` with `cpu_workers` processes (default: the usable cores; 1 means the
    sequential `CpuDecoder`), or `CpuDecoder` when the processes cannot start. Each step down is logged with its
    reason; the choice is logged at INFO. Raises ValueError for `gpus` neither None, "all" nor distinct GPU ids.
    """
    if isinstance(gpus, str) and gpus != "all":
        raise ValueError(f'gpus must be None, "all" or a list of GPU ids, got {gpus!r}')
    paths = DecodePaths()
    decoder: FrameDecoder = CpuDecoder(paths=paths)
    path = "cpu"
    workers = cpu_workers or len(os.sched_getaffinity(0))
    if workers > 1:
        try:
            decoder = ParallelCpuDecoder(workers, max_gop_size, part_timeout_s, paths=paths)
            path = "cpu_parallel"
        except PoolUnavailable as exc:
            log.warning("GOP-parallel CPU decoding unavailable, decoding sequentially: %s", exc)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if str(device) == "auto" else device
    if torch.device(device).type == "cuda":
        index = torch.device(device).index or 0
        # "all": the output GPU first, so that a video of fewer GOP tasks than GPUs decodes where it is needed
        gpu_ids = ((index,) if gpus is None else
                   (index, *(g for g in range(torch.cuda.device_count()) if g != index)) if gpus == "all" else
                   tuple(int(g) for g in gpus))
        try:
            decoder = NvdecDecoder(gpu_ids, nvdec_sessions, max_gop_size, decoder, paths,
                                   output_device=torch.device("cuda", index), helper_processes=helper_processes,
                                   processes_per_gpu=processes_per_gpu)
            path = "nvdec"
        except NvdecUnavailable as exc:
            log.warning("NVDEC unavailable on GPUs %s, decoding on the CPU: %s", list(gpu_ids), exc)
        except ValueError:  # gpus repeats an id: a configuration error, not a reason to decode on the CPU
            DecoderChoice(decoder, path, paths).close()
            raise
    log.info("FlashCodec decodes video on the %s path", path)
    return DecoderChoice(decoder, path, paths)
