"""Qwen2.5-VL's media rules behind the family interface: `flashcodec.sampling` (qwen-vl-utils' arithmetic) and
`flashcodec.preprocess` (transformers' Qwen2-VL processors) hold them; this adapts their calls."""
from __future__ import annotations

from dataclasses import replace

from flashcodec.families.base import IMAGE_SETTINGS, Budgets, MediaOptions, PromptExpansion, groups_from
from flashcodec.families.cap import STEPS, Info, OverCap, highest, plan_all, total_tokens
from flashcodec.probe import ImageInfo, VideoInfo
from flashcodec.sampling import FPS, IMAGE_MIN_PIXELS, MERGE_SIZE, PATCH_DIM, TEMPORAL_PATCH_SIZE, VIDEO_MIN_PIXELS, \
    ImagePlan, VideoPlan, plan_image, plan_video

IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"


class Qwen25VL:
    """The Qwen2.5-VL family (`flashcodec.families.base.Family`): sizes by pixel bounds, video by fps.

    Options honoured: `fps` (default 2.0), `max_pixels` and `min_pixels` (qwen-vl-utils' and transformers' processor
    kwargs of those names); `num_frames` and InternVL3's tile settings (`IMAGE_SETTINGS`: `max_tiles`, `min_tiles`,
    `dynamic_image_size`) are refused (ValueError naming the first set).
    """

    name = "qwen2_5_vl"
    model_type = "qwen2_5_vl"
    budgets = Budgets(encode=10240, prefill=2048)  # the paper's deployment notes (docs/design.md, "Scheduling")
    frames_per_group = TEMPORAL_PATCH_SIZE
    patch_dim = PATCH_DIM
    options = ("fps", "max_pixels", "min_pixels")
    frame_settings = ("fps",)
    size_settings = ("max_pixels", "min_pixels")
    placeholders = {"image": IMAGE_PAD, "video": VIDEO_PAD}
    part_texts = {kind: f"<|vision_start|>{pad}<|vision_end|>" for kind, pad in placeholders.items()}
    # M-RoPE's positions (transformers' get_rope_index) are read from these, so a prompt may not bring its own
    reserved_tokens = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", IMAGE_PAD, VIDEO_PAD)
    fewer_tokens = {"image": ("max_pixels",), "video": ("fps", "max_pixels")}

    def plan_image(self, info: ImageInfo, options: MediaOptions = MediaOptions()) -> ImagePlan:
        """`flashcodec.sampling.plan_image` with `options.max_pixels` and `min_pixels`; raises as it does."""
        options.refuse("Qwen2.5-VL", "fps", "num_frames", *IMAGE_SETTINGS)
        return plan_image(info, max_pixels=options.max_pixels, min_pixels=options.min_pixels)

    def plan_video(self, info: VideoInfo, options: MediaOptions = MediaOptions()) -> VideoPlan:
        """`flashcodec.sampling.plan_video` with `options.fps` (default 2.0), `max_pixels` and `min_pixels` (a
        frame's); raises as it does."""
        options.refuse("Qwen2.5-VL", "num_frames", *IMAGE_SETTINGS)
        return plan_video(info, fps=FPS if options.fps is None else options.fps, max_pixels=options.max_pixels,
                          min_pixels=options.min_pixels)

    def expand(self, kind: str, grid_thw: tuple[int, int, int]) -> PromptExpansion:
        """One run of `t*h*w / 4` pads in place of the placeholder (`Qwen2_5_VLProcessor.__call__`)."""
        pad = self.placeholders[kind]
        t, h, w = grid_thw
        return PromptExpansion(pad, pad, (t * h * w // (MERGE_SIZE * MERGE_SIZE),))

    def image_groups(self, image, plan: ImagePlan, device=None):
        """An RGB Pillow image -> its one group: (0, `preprocess.image_patches`) on `device` (None: the CPU)."""
        from flashcodec.preprocess import image_patches

        return iter([(0, image_patches(image, plan.resized_height, plan.resized_width, device))])

    def video_groups_from(self, plan: VideoPlan, first: int) -> VideoPlan:
        """`base.groups_from`, two frames a group; `grid_thw` counts the groups left."""
        t, h, w = plan.grid_thw
        return groups_from(plan, first, self.frames_per_group, grid_thw=(t - first, h, w))

    def video_group(self, frames, plan: VideoPlan):
        """Two decoded frames -> `preprocess.video_group_patches` at the plan's size."""
        from flashcodec.preprocess import video_group_patches

        return video_group_patches(frames, plan.resized_height, plan.resized_width)

    def lower_visual_tokens(self, infos: list[Info], options: MediaOptions, plans: list[ImagePlan | VideoPlan],
                            cap: int) -> tuple[list[ImagePlan | VideoPlan], dict]:
        """`base.Family.lower_visual_tokens` by fps, then pixels: first one fps for every video, the highest that fits
        (bisection in (0, the request's fps]); at the lowest (each video at its minimum frame count,
        `sampling.FPS_MIN_FRAMES`) still over, then one scale s in (0, 1] of every item's resized area, the highest
        that fits (each item's `max_pixels` = s x its area at that fps, at least its kind's minimum:
        `sampling.VIDEO_MIN_PIXELS`, `IMAGE_MIN_PIXELS`, or the request's `min_pixels`, which the cap keeps). Returns
        the plans and `fps` (None: unchanged) and `max_pixels` (per item). Raises OverCap when even the lowest fps
        and pixels exceed `cap`; ValueError / MediaError as `plan_video` and `plan_image`."""
        fps = FPS if options.fps is None else options.fps

        def at(f: float, pixels: list[int | None]) -> list[ImagePlan | VideoPlan]:
            return plan_all(self, infos, [replace(options, fps=f, max_pixels=px) for px in pixels])

        requested = [options.max_pixels] * len(infos)
        has_video = any(isinstance(info, VideoInfo) for info in infos)
        lowest_fps = fps * 2.0 ** -STEPS  # below any clip's minimum frame count: smart_nframes' floor applies
        new_fps = fps
        if has_video:
            fewest = total_tokens(at(lowest_fps, requested))  # every video at its fewest frames
            # the highest fps that fits, or (none fits) the highest that still gives the fewest frames
            new_fps = highest(lambda f: total_tokens(at(f, requested)) <= max(cap, fewest), lowest_fps, fps)
            plans = at(new_fps, requested)
        pixels: tuple[int | None, ...] | None = None
        if total_tokens(plans) > cap:
            areas = [p.resized_height * p.resized_width for p in plans]
            floors = [max(options.min_pixels or 0, VIDEO_MIN_PIXELS if isinstance(i, VideoInfo) else IMAGE_MIN_PIXELS)
                      for i in infos]

            def scaled(s: float) -> list[int]:
                return [max(int(floor), int(s * area)) for floor, area in zip(floors, areas)]

            smallest = at(new_fps, scaled(0.0))
            if total_tokens(smallest) > cap:
                raise OverCap(total_tokens(smallest), cap, "fps and pixels")
            pixels = tuple(scaled(highest(lambda s: total_tokens(at(new_fps, scaled(s))) <= cap, 0.0, 1.0)))
            plans = at(new_fps, list(pixels))
        return plans, {"fps": new_fps if has_video and new_fps != fps else None,
                       "max_pixels": pixels or (None,) * len(infos)}
