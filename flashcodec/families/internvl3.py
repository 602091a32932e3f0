"""InternVL3's media rules from metadata alone: which tiles and frames, how many patches and tokens, prompt text.

The reference is transformers 5.17's InternVL processor (`models/internvl/processing_internvl.py`), its image
processor (`models/got_ocr2/image_processing_got_ocr2.py`, `crop_to_patches=True`, or False for one tile) and its
video processor (`models/internvl/video_processing_internvl.py`), configured as the InternVL3 `-hf` checkpoints are
(448 px tiles, ImageNet mean/std, 1..12 tiles; `convert_internvl_weights_to_hf.py` in transformers' repository, not in
its wheel).
The arithmetic is reproduced here (torchvision is not a dependency; torch only for the frame indices, imported when
called); tests/unit/flashcodec/test_internvl3_*.py compare it with those classes. The pixel work is
`flashcodec.families.internvl3_pixels`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

from flashcodec.errors import MediaError
from flashcodec.families.base import IMAGE_SETTINGS, Budgets, MediaOptions, PromptExpansion, groups_from
from flashcodec.families.cap import Info, OverCap, highest_int, plan_all, total_tokens
from flashcodec.probe import ImageInfo, VideoInfo

IMAGENET_MEAN = (0.485, 0.456, 0.406)  # transformers.utils.constants.IMAGENET_DEFAULT_MEAN
IMAGENET_STD = (0.229, 0.224, 0.225)  # IMAGENET_DEFAULT_STD
START_IMAGE, END_IMAGE, CONTEXT, VIDEO = "<img>", "</img>", "<IMG_CONTEXT>", "<video>"


@dataclass(frozen=True)
class InternVL3Config:
    """The preprocessing settings of an InternVL3 checkpoint (its `preprocessor_config.json` and processor).

    `tile_size` (px) is the vision tower's `image_size`; `patch_size` (px) its patch; `merge` the side of the
    pixel shuffle (`downsample_ratio` 0.5 -> 2x2 patches per LLM token). `min_tiles`/`max_tiles` are the image
    processor's `min_patches`/`max_patches`; `num_frames` the segments a video is cut into when a request names
    neither a frame count nor fps (InternVL's model card samples `num_segments=8`). Raises ValueError for values the
    processor would misuse (tiles not covered by whole patches, an empty tile range).
    """

    tile_size: int = 448
    patch_size: int = 14
    merge: int = 2
    min_tiles: int = 1
    max_tiles: int = 12
    num_frames: int = 8
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD

    def __post_init__(self) -> None:
        if self.tile_size % (self.patch_size * self.merge):
            raise ValueError(f"tile_size {self.tile_size} must be a multiple of patch_size * merge "
                             f"({self.patch_size} * {self.merge})")
        _check_tiles(self.min_tiles, self.max_tiles)
        if self.num_frames < 1:
            raise ValueError(f"num_frames must be >= 1, got {self.num_frames}")

    @property
    def patches_per_tile(self) -> int:
        """Vision-tower input patches of one tile (1024 for 448 / 14)."""
        return (self.tile_size // self.patch_size) ** 2

    @property
    def tokens_per_tile(self) -> int:
        """LLM tokens of one tile after the pixel shuffle: the processor's `image_seq_length` (256)."""
        return self.patches_per_tile // (self.merge * self.merge)


def _check_tiles(min_tiles: int, max_tiles: int, whose: str = "") -> None:
    """Raises ValueError naming both values unless 1 <= `min_tiles` <= `max_tiles` (`whose`: where max_tiles' value
    came from, written after it)."""
    if not 1 <= min_tiles <= max_tiles:
        raise ValueError(f"min_tiles {min_tiles} and max_tiles {max_tiles}{whose}: need 1 <= min_tiles <= max_tiles")


def tile_grids(min_tiles: int, max_tiles: int) -> list[tuple[int, int]]:
    """(columns, rows) of every grid with `min_tiles` .. `max_tiles` tiles, ordered by tile count (stable: columns
    then rows within a count). `get_all_supported_aspect_ratios` in image_processing_got_ocr2.py."""
    grids = [(w, h) for w in range(1, max_tiles + 1) for h in range(1, max_tiles + 1)
             if min_tiles <= w * h <= max_tiles]
    return sorted(grids, key=lambda grid: grid[0] * grid[1])


def best_grid(height: int, width: int, tile_size: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """(columns, rows) of the tile grid whose aspect ratio is closest to `width / height` (pixels).

    Ties go to the later grid (more tiles) while the image's area exceeds half of that grid's tile area.
    `get_optimal_tiled_canvas` in image_processing_got_ocr2.py, the same float operations in the same order.
    Raises ValueError for a size below 1 px or an empty tile range.
    """
    if height < 1 or width < 1:
        raise ValueError(f"tiles: height and width must be >= 1, got {height}x{width}")
    _check_tiles(min_tiles, max_tiles)
    aspect_ratio = width / height
    area = width * height
    best_diff, best = float("inf"), (1, 1)
    for grid in tile_grids(min_tiles, max_tiles):
        diff = abs(aspect_ratio - grid[0] / grid[1])
        if diff < best_diff:
            best_diff, best = diff, grid
        elif diff == best_diff and area > 0.5 * tile_size * tile_size * grid[0] * grid[1]:
            best = grid
    return best


class _Tiles:
    """What both plans derive from their groups of square tiles."""

    num_groups: int
    patches_per_group: int
    tokens_per_group: int

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        """(groups, 32, 32): each group's patches as a square grid."""
        side = math.isqrt(self.patches_per_group)
        return self.num_groups, side, side

    @property
    def num_tokens(self) -> int:
        return self.num_groups * self.tokens_per_group


@dataclass(frozen=True)
class TiledImagePlan(_Tiles):
    """An image cut into tiles: resized to `columns * tile_size` x `rows * tile_size` px and cut row by row, then a
    `thumbnail` (the whole image resized to one tile) last when there is more than one tile.

    Each tile is one group: `patches_per_group` (1024) patches of 3x14x14, `tokens_per_group` (256) LLM tokens;
    `grid_thw` = (tiles, 32, 32) in patches, so the 2x2 merge arithmetic of the other stages holds.
    """

    family: ClassVar[str] = "internvl3"
    kind: ClassVar[str] = "image"
    columns: int
    rows: int
    thumbnail: bool
    tile_size: int
    num_groups: int
    patches_per_group: int
    tokens_per_group: int


@dataclass(frozen=True)
class SegmentVideoPlan(_Tiles):
    """A video sampled by segments: `frame_indices` (presentation order, increasing) at `frame_times_s` (seconds
    from the first frame), each frame resized to one `tile_size` tile (no tiling) and one group of
    `patches_per_group` patches / `tokens_per_group` tokens. `grid_thw` = (frames, 32, 32) in patches."""

    family: ClassVar[str] = "internvl3"
    kind: ClassVar[str] = "video"
    frame_indices: tuple[int, ...]
    frame_times_s: tuple[float, ...]
    tile_size: int
    num_groups: int
    patches_per_group: int
    tokens_per_group: int


def segment_indices(total_frames: int, num_frames: int) -> list[int]:
    """`num_frames` frame indices, one in the middle of each of `num_frames` equal segments of `total_frames`.

    `InternVLVideoProcessor.sample_frames` with `initial_shift=True`: `torch.arange(total / n / 2, total, total / n)
    .int()` (torch's own call, for its float32 steps and truncation). Raises MediaError naming both counts when
    the video has fewer frames than segments (the processor's ValueError), ValueError for `num_frames` < 1.
    """
    if num_frames < 1:
        raise ValueError(f"num_frames must be >= 1, got {num_frames}")
    if num_frames > total_frames:
        raise MediaError(f"video: {total_frames} frames, fewer than the {num_frames} segments to sample (num_frames)")
    import torch  # the reference's op, for its exact rounding; kept out of module imports (orchestrator: no torch)

    step = total_frames / num_frames
    return torch.arange(step / 2, total_frames, step).int().tolist()


class InternVL3:
    """The InternVL3 family (`flashcodec.families.base.Family`): tiles for images, segments for video.

    Options honoured: `num_frames` (segments), else `fps` (`int(frames / video fps * fps)` frames, the processor's
    rule), else `config.num_frames`; `max_tiles` and `min_tiles` (in place of `config.max_tiles` / `min_tiles`, above
    them too, as transformers' `max_patches` / `min_patches` and vLLM's `max_dynamic_patch` / `min_dynamic_patch` are
    taken); `dynamic_image_size` (False: one tile, `tile_range`). `max_pixels` and `min_pixels` are refused
    (ValueError): InternVL's sizes are whole tiles.
    """

    name = "internvl3"
    model_type = "internvl"
    budgets = Budgets(encode=5120, prefill=2048)  # the paper's deployment notes (docs/design.md, "Scheduling")
    frames_per_group = 1
    options = ("fps", "num_frames", *IMAGE_SETTINGS)
    frame_settings = ("num_frames", "fps")  # num_frames segments, else fps's (plan_video)
    size_settings = ("max_tiles", "min_tiles")  # an image's grid (dynamic_image_size, its own setting, is not)
    placeholders = {"image": CONTEXT, "video": VIDEO}  # what the chat template writes for an image / a video
    part_texts = placeholders
    reserved_tokens = (START_IMAGE, END_IMAGE, CONTEXT, VIDEO)
    fewer_tokens = {"image": ("max_tiles", "min_tiles"), "video": ("num_frames",)}

    def __init__(self, config: InternVL3Config = InternVL3Config()):
        self.config = config

    @property
    def patch_dim(self) -> int:
        """Values per patch row: 3 * patch_size**2 (588)."""
        return 3 * self.config.patch_size ** 2

    def tile_range(self, options: MediaOptions) -> tuple[int, int]:
        """(fewest, most) tiles of an image's grid at `options`: (1, 1) when `dynamic_image_size` is False, whatever
        `min_tiles` and `max_tiles` say (vLLM 0.26 `resolve_internvl_min_max_num`; transformers 5.17
        GotOcr2ImageProcessor with `crop_to_patches=False` resizes an image to one tile); else `min_tiles` and
        `max_tiles`, each the config's where None. Raises ValueError naming both when min_tiles is above max_tiles."""
        c = self.config
        if options.dynamic_image_size is False:
            return 1, 1
        low = c.min_tiles if options.min_tiles is None else options.min_tiles
        high = c.max_tiles if options.max_tiles is None else options.max_tiles
        _check_tiles(low, high, " (the checkpoint's)" if options.max_tiles is None else "")
        return low, high

    def plan_image(self, info: ImageInfo, options: MediaOptions = MediaOptions()) -> TiledImagePlan:
        """The tiles of an image of `info`'s size (pixels, as displayed): the grid of `tile_range(options)` tiles whose
        aspect ratio is closest to the image's (`best_grid`), and a thumbnail when it has more than one tile.

        Raises MediaError naming a zero-size image, ValueError for options it does not honour or a `min_tiles` above
        the `max_tiles` that applies (naming both).
        """
        options.refuse("InternVL3", "max_pixels", "min_pixels")
        c = self.config
        if info.width < 1 or info.height < 1:
            raise MediaError(f"image: {info.width}x{info.height} has no pixels")
        columns, rows = best_grid(info.height, info.width, c.tile_size, *self.tile_range(options))
        thumbnail = columns * rows > 1
        return TiledImagePlan(columns, rows, thumbnail, c.tile_size, columns * rows + thumbnail, c.patches_per_tile,
                              c.tokens_per_tile)

    def plan_video(self, info: VideoInfo, options: MediaOptions = MediaOptions()) -> SegmentVideoPlan:
        """The frames of a video from its probe (`info.num_frames`, `info.fps`, `info.frame_pts_s`): `num_frames`
        segments (the request's, else `int(frames / video fps * fps)` (at least 1) when it sets `fps`, else the
        config's), at most the video's frames. Where transformers' processor refuses a video with fewer frames than
        segments (case C3: short clips), this takes every frame, as vLLM 0.26's video loader does
        (`min(num_frames, total)`).

        Raises MediaError for a video without frames; ValueError for options it does not honour or out of range.
        """
        options.refuse("InternVL3", "max_pixels", "min_pixels", *IMAGE_SETTINGS)
        c = self.config
        total = info.num_frames
        if total < 1:
            raise MediaError("video: no frames")
        num_frames = options.num_frames
        if num_frames is None and options.fps is not None:
            num_frames = max(1, int(total / info.fps * options.fps))  # shorter than a frame at fps: one frame
        num_frames = c.num_frames if num_frames is None else num_frames
        indices = segment_indices(total, min(num_frames, total))  # raises ValueError for num_frames < 1
        start = info.frame_pts_s[0]
        return SegmentVideoPlan(tuple(indices), tuple(info.frame_pts_s[i] - start for i in indices), c.tile_size,
                                len(indices), c.patches_per_tile, c.tokens_per_tile)

    def expand(self, kind: str, grid_thw: tuple[int, int, int]) -> PromptExpansion:
        """What replaces one placeholder of `kind` for an item of `grid_thw` (tiles or frames, 32, 32).

        An image: `<img>` + 256 * tiles `<IMG_CONTEXT>` + `</img>` (`InternVLProcessor.replace_image_token`); a
        video: per frame i (from 1) `Frame{i}: <img>` + 256 `<IMG_CONTEXT>` + `</img>`, joined by newlines
        (`replace_video_token`). Raises ValueError for another kind.
        """
        tokens = self.config.tokens_per_tile
        if kind == "image":
            return PromptExpansion(f"{START_IMAGE}{CONTEXT}{END_IMAGE}", CONTEXT, (tokens * grid_thw[0],))
        if kind == "video":
            frames = "\n".join(f"Frame{i + 1}: {START_IMAGE}{CONTEXT}{END_IMAGE}" for i in range(grid_thw[0]))
            return PromptExpansion(frames, CONTEXT, (tokens,) * grid_thw[0])
        raise ValueError(f"media kind must be image or video, got {kind!r}")

    def image_groups(self, image, plan: TiledImagePlan, device=None):
        """See `flashcodec.families.internvl3_pixels.image_rows`; yields (tile, rows) per tile, on `device`."""
        from flashcodec.families.internvl3_pixels import image_rows

        return enumerate(image_rows(image, plan, self.config, device).split(plan.patches_per_group))

    def video_groups_from(self, plan: SegmentVideoPlan, first: int) -> SegmentVideoPlan:
        """`base.groups_from`, a frame a group (`grid_thw` follows `num_groups`)."""
        return groups_from(plan, first, self.frames_per_group)

    def video_group(self, frames, plan: SegmentVideoPlan):
        """See `flashcodec.families.internvl3_pixels.frame_rows`."""
        from flashcodec.families.internvl3_pixels import frame_rows

        return frame_rows(frames, plan, self.config)

    def lower_visual_tokens(self, infos: list[Info], options: MediaOptions,
                            plans: list[TiledImagePlan | SegmentVideoPlan], cap: int
                            ) -> tuple[list[TiledImagePlan | SegmentVideoPlan], dict]:
        """`base.Family.lower_visual_tokens` by frames, then tiles: first one frame count n for every video (each keeps
        min(n, its frames now)), the highest that fits; at one frame a video still over, then one `max_tiles` for
        every image, the highest that fits, down to the request's `min_tiles` (kept, as the request's `max_tiles`
        stays an upper bound). Returns the plans and `num_frames` (the most frames of a video) and `max_tiles` (None:
        unchanged). Raises OverCap when one frame and `min_tiles` tiles exceed `cap`; ValueError / MediaError as
        `plan_video` and `plan_image`."""
        frames = [p.num_groups if isinstance(i, VideoInfo) else 0 for i, p in zip(infos, plans)]
        tiles = max((p.num_groups for i, p in zip(infos, plans) if isinstance(i, ImageInfo)), default=1)
        tiles = min(tiles, options.max_tiles or tiles)  # the request's max_tiles stays an upper bound
        # the request's min_tiles, a lower bound (an image's tiles, its thumbnail included, are at least as many)
        fewest = min(tiles, options.min_tiles or self.config.min_tiles)

        def at(n: int, m: int) -> list[TiledImagePlan | SegmentVideoPlan]:
            return plan_all(self, infos, [replace(options, num_frames=min(n, f) or None, max_tiles=m) for f in frames])

        new_frames = highest_int(lambda n: total_tokens(at(n, tiles)) <= cap, max(frames))
        new_tiles = highest_int(lambda m: total_tokens(at(new_frames, m)) <= cap, tiles, fewest)
        plans = at(new_frames, new_tiles)
        if total_tokens(plans) > cap:
            raise OverCap(total_tokens(plans), cap, "num_frames and max_tiles" + (
                f" (max_tiles no lower than min_tiles {fewest})" if fewest > 1 else ""))
        return plans, {"num_frames": new_frames if new_frames < max(frames) else None,
                       "max_tiles": new_tiles if new_tiles < tiles else None}
