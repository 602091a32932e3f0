"""Qwen2.5-VL's media rules behind the family interface: `flashcodec.sampling` (qwen-vl-utils' arithmetic) and
`flashcodec.preprocess` (transformers' Qwen2-VL processors) hold them; this adapts their calls."""
from __future__ import annotations

from flashcodec.families.base import MediaOptions, PromptExpansion, groups_from
from flashcodec.probe import ImageInfo, VideoInfo
from flashcodec.sampling import FPS, MERGE_SIZE, PATCH_DIM, TEMPORAL_PATCH_SIZE, ImagePlan, VideoPlan, plan_image, \
    plan_video

IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"


class Qwen25VL:
    """The Qwen2.5-VL family (`flashcodec.families.base.Family`): sizes by pixel bounds, video by fps.

    Options honoured: `fps` (default 2.0) and `max_pixels`; `num_frames` and `max_tiles` are refused (ValueError).
    """

    name = "qwen2_5_vl"
    frames_per_group = TEMPORAL_PATCH_SIZE
    patch_dim = PATCH_DIM
    options = ("fps", "max_pixels")
    placeholders = {"image": IMAGE_PAD, "video": VIDEO_PAD}
    # M-RoPE's positions (transformers' get_rope_index) are read from these, so a prompt may not bring its own
    reserved_tokens = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", IMAGE_PAD, VIDEO_PAD)
    fewer_tokens = {"image": ("max_pixels",), "video": ("fps", "max_pixels")}

    def plan_image(self, info: ImageInfo, options: MediaOptions = MediaOptions()) -> ImagePlan:
        """`flashcodec.sampling.plan_image` with `options.max_pixels`; raises as it does."""
        options.refuse("Qwen2.5-VL", "fps", "num_frames", "max_tiles")
        return plan_image(info, max_pixels=options.max_pixels)

    def plan_video(self, info: VideoInfo, options: MediaOptions = MediaOptions()) -> VideoPlan:
        """`flashcodec.sampling.plan_video` with `options.fps` (default 2.0) and `max_pixels`; raises as it does."""
        options.refuse("Qwen2.5-VL", "num_frames", "max_tiles")
        return plan_video(info, fps=FPS if options.fps is None else options.fps, max_pixels=options.max_pixels)

    def expand(self, kind: str, grid_thw: tuple[int, int, int]) -> PromptExpansion:
        """One run of `t*h*w / 4` pads in place of the placeholder (`Qwen2_5_VLProcessor.__call__`)."""
        pad = self.placeholders[kind]
        t, h, w = grid_thw
        return PromptExpansion(pad, pad, (t * h * w // (MERGE_SIZE * MERGE_SIZE),))

    def image_groups(self, image, plan: ImagePlan):
        """An RGB Pillow image -> its one group: (0, `preprocess.image_patches`)."""
        from flashcodec.preprocess import image_patches

        return iter([(0, image_patches(image, plan.resized_height, plan.resized_width))])

    def video_groups_from(self, plan: VideoPlan, first: int) -> VideoPlan:
        """`base.groups_from`, two frames a group; `grid_thw` counts the groups left."""
        t, h, w = plan.grid_thw
        return groups_from(plan, first, self.frames_per_group, grid_thw=(t - first, h, w))

    def video_group(self, frames, plan: VideoPlan):
        """Two decoded frames -> `preprocess.video_group_patches` at the plan's size."""
        from flashcodec.preprocess import video_group_patches

        return video_group_patches(frames, plan.resized_height, plan.resized_width)
