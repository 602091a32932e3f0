"""What a model family contributes to media handling, behind one interface the stages call.

A family (Qwen2.5-VL, InternVL3) decides, from metadata alone, which frames or tiles an image or video becomes and how
many patches and LLM tokens each group of them gives (the orchestrator, before decoding), and how a request's media
are lowered to fit a visual-token cap; what text stands for an item in the prompt; and, from decoded pixels, each
group's patch rows (FlashCodec). It also names its checkpoints' `model_type` and its default per-step budgets, so that
the orchestrator learns all it needs of the served family without torch. A *group* is what the vision
tower encodes whole and the scheduler never splits: Qwen2.5-VL's temporal patch (2 frames, or an image), InternVL3's
448x448 tile (one per video frame; an image's tiles and thumbnail). A plan's `grid_thw` is (groups, h, w) in
patches, and each group's `h*w` patches become `h*w / 4` LLM tokens (Qwen's 2x2 merge, InternVL's pixel shuffle 0.5).
Nothing here imports torch: the pixel methods import their family's torch module when called.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, Iterator, Protocol, Sequence

from flashcodec.probe import ImageInfo, VideoInfo


@dataclass(frozen=True)
class Budgets:
    """Default per-step budgets: `encode` vision-encoder input patches (before the 2x2 merge / pixel shuffle),
    `prefill` LLM tokens (docs/design.md, "Scheduling"). Raises ValueError for non-positive values."""

    encode: int
    prefill: int

    def __post_init__(self) -> None:
        if self.encode < 1 or self.prefill < 1:
            raise ValueError(f"budgets must be positive, got {self}")


VIDEO_SETTINGS = ("fps", "num_frames")  # the `MediaOptions` fields about videos alone
IMAGE_SETTINGS = ("max_tiles", "min_tiles", "dynamic_image_size")  # those about images alone (InternVL3's tiles)


@dataclass(frozen=True)
class MediaOptions:
    """A request's media settings; each family honours some and refuses the others (ValueError naming them).

    `fps`: frames sampled per second of video; `max_pixels` / `min_pixels`: the largest / smallest area of a resized
    frame or image, pixels (Qwen2.5-VL); `num_frames`: segments a video is cut into; `max_tiles` / `min_tiles`: most /
    fewest tiles of an image's grid, its thumbnail not counted; `dynamic_image_size`: False for no grid, the image
    resized to one tile (InternVL3). None: the family's default.
    """

    fps: float | None = None
    max_pixels: int | None = None
    min_pixels: int | None = None
    num_frames: int | None = None
    max_tiles: int | None = None
    min_tiles: int | None = None
    dynamic_image_size: bool | None = None

    def for_kind(self, kind: str) -> "MediaOptions":
        """The settings about a media item of `kind`: an image drops `VIDEO_SETTINGS`, a video `IMAGE_SETTINGS`."""
        return replace(self, **dict.fromkeys(VIDEO_SETTINGS if kind == "image" else IMAGE_SETTINGS))

    def refuse(self, family: str, *names: str) -> None:
        """Raises ValueError naming the first of `names` that is set: `family` has no such setting."""
        for f in fields(self):
            if f.name in names and getattr(self, f.name) is not None:
                raise ValueError(f"{f.name} does not apply to {family} (got {getattr(self, f.name)!r})")


@dataclass(frozen=True)
class PromptExpansion:
    """The text that replaces one media placeholder of the chat template, each run of visual tokens written as ONE
    `token` (a special token: the text around it tokenizes the same whatever the run's length), and `runs`: the
    length of each run in tokens, in order. Writing the runs out gives the processor's text."""

    text: str
    token: str
    runs: tuple[int, ...]


class MediaPlan(Protocol):
    """What every family's image or video plan gives the stages (a frozen dataclass; `repr` names it whole)."""

    family: ClassVar[str]  # the name of the family whose rules made it
    kind: ClassVar[str]  # "image" or "video"
    num_groups: int
    patches_per_group: int
    tokens_per_group: int

    @property
    def grid_thw(self) -> tuple[int, int, int]: ...


def groups_from(plan: Any, first: int, frames_per_group: int, **changed: Any) -> Any:
    """A video `plan`'s groups `first` .. `num_groups - 1` alone: its frames from group `first` on (`frame_indices`
    and `frame_times_s`, `frames_per_group` a group), `num_groups` less `first`, and `changed` (the family's other
    fields that count groups). What `Family.video_groups_from` gives. Raises ValueError when `first` is not a group."""
    if not 0 <= first < plan.num_groups:
        raise ValueError(f"video: group {first} is not one of the plan's {plan.num_groups}")
    skipped = frames_per_group * first
    return replace(plan, frame_indices=plan.frame_indices[skipped:], frame_times_s=plan.frame_times_s[skipped:],
                   num_groups=plan.num_groups - first, **changed)


class Family(Protocol):
    """One model family's media rules. Metadata side (no torch): `plan_image`, `plan_video`, `expand`; pixel side:
    `image_groups`, `video_group`, which give float32 rows of `patch_dim` values, `patches_per_group` per group, on
    the device of the pixels they are given (an image's: `device`, where its resized uint8 pixels are normalised and
    cut, the same values on any device)."""

    name: str  # the family's name in presets and in a plan's `family`
    model_type: str  # the `model_type` of its checkpoints' config.json
    budgets: Budgets  # the scheduler's default budgets for it
    frames_per_group: int  # decoded video frames per group
    patch_dim: int  # values per patch row
    options: tuple[str, ...]  # the `MediaOptions` fields it honours (the others it refuses)
    # the `options` that each choose a video's frames, the one `plan_video` follows first when several are set; a
    # server default fills none of them when a request sets one (`orchestrator.media.with_media_defaults`)
    frame_settings: tuple[str, ...]
    # the `options` that together set an item's size (Qwen2.5-VL's pixel bounds): as one setting, a server default
    # fills none of them when a request sets one (a request's max_pixels is not held below the server's min_pixels)
    size_settings: tuple[str, ...]
    placeholders: dict[str, str]  # media kind -> the chat template's placeholder for it
    # media kind -> the text standing for a media part in a message whose content a chat template takes as one string
    # (orchestrator.content_format; vLLM 0.26's get_placeholder_str of the model), holding its placeholder
    part_texts: dict[str, str]
    reserved_tokens: tuple[str, ...]  # tokens only the server may place in a prompt
    fewer_tokens: dict[str, tuple[str, ...]]  # media kind -> the request settings that lower its visual tokens

    def plan_image(self, info: ImageInfo, options: MediaOptions = MediaOptions()) -> MediaPlan: ...

    def plan_video(self, info: VideoInfo, options: MediaOptions = MediaOptions()) -> MediaPlan: ...

    def expand(self, kind: str, grid_thw: tuple[int, int, int]) -> PromptExpansion: ...

    def image_groups(self, image: Any, plan: MediaPlan, device: Any = None) -> Iterator[tuple[int, Any]]: ...

    def video_group(self, frames: Sequence[Any], plan: MediaPlan) -> Any: ...

    def lower_visual_tokens(self, infos: list[ImageInfo | VideoInfo], options: MediaOptions, plans: list[MediaPlan],
                            cap: int) -> tuple[list[MediaPlan], dict[str, Any]]:
        """The plans of `infos` (a request's media, in order; `plans`: theirs at `options`, over `cap`) lowered by the
        family's own settings until their visual tokens are at most `cap`; the request's settings stay upper bounds.
        Returns the plans and the settings it changed (`orchestrator.visual_cap.CapApplied`'s fields; None where
        unchanged). Raises `cap.OverCap` when even the lowest settings exceed `cap`, ValueError / MediaError as
        `plan_image` and `plan_video`."""

    def video_groups_from(self, plan: MediaPlan, first: int) -> MediaPlan:
        """A video plan's groups `first` .. `num_groups - 1` alone (their frames, renumbered from 0): what is left to
        decode when its first groups are in the prefix cache. Raises ValueError when `first` is not a group."""
