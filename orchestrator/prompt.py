"""The prompt: chat template, visual-token expansion, and where each temporal-patch group's tokens sit.

The visual-token count of each item comes from metadata alone (flashcodec's probe + sampling plan),
before any frame is decoded: a group of grid (1, h, w) patches becomes ``h*w / merge**2`` tokens
(Qwen2.5-VL: ``merge_size`` 2, transformers' ``Qwen2VLImageProcessor``).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from orchestrator.sampling_params import InvalidInput

MERGE = 2  # spatial_merge_size of Qwen2.5-VL's vision tower
USER_TEXT = "\x00unifiedserve-user-text\x00"  # stands for the user's text while the template is applied
# transformers' encode(split_special_tokens=...) sets that flag on the tokenizer's one shared Rust object, and
# prompts are built in worker threads: unserialised, a template's "<|image_pad|>" can be split into text.
_ENCODE_LOCK = threading.Lock()


@dataclass(frozen=True)
class MediaLayout:
    """One image or video in the prompt. ``grid_thw`` in patches; ``token_offset``: its first visual token."""

    kind: str
    grid_thw: tuple[int, int, int]
    second_per_grid_t: float
    token_offset: int

    @property
    def tokens_per_group(self) -> int:
        return self.grid_thw[1] * self.grid_thw[2] // (MERGE * MERGE)

    @property
    def patches_per_group(self) -> int:
        return self.grid_thw[1] * self.grid_thw[2]

    @property
    def num_groups(self) -> int:
        """Temporal-patch groups (2 frames each; an image is one group)."""
        return self.grid_thw[0]

    @property
    def num_tokens(self) -> int:
        return self.num_groups * self.tokens_per_group


@dataclass(frozen=True)
class Prompt:
    input_ids: tuple[int, ...]
    media: tuple[MediaLayout, ...]

    @property
    def num_visual_tokens(self) -> int:
        return sum(m.num_tokens for m in self.media)

    def check_length(self, max_tokens: int, max_model_len: int) -> None:
        """Refuses a request whose prompt plus ``max_tokens`` output tokens exceed ``max_model_len`` tokens.

        Raises InvalidInput naming what to change: ``max_tokens`` (with the largest value that fits) when the
        prompt leaves room for output, else the prompt (fps / max_pixels when it has visual tokens).
        """
        n, visual = len(self.input_ids), self.num_visual_tokens
        if n + max_tokens <= max_model_len:
            return
        counts = f"{n - visual} text tokens + {visual} visual tokens"
        fewer_visual = " (lower fps or max_pixels for fewer visual tokens)" if visual else ""
        if n < max_model_len:
            raise InvalidInput(
                f"sampling_parameters: max_tokens {max_tokens} plus the prompt's {n} tokens ({counts}) exceeds "
                f"max_model_len {max_model_len}: max_tokens can be at most {max_model_len - n}{fewer_visual}")
        room = max_model_len - (n - visual) - 1  # visual tokens that would leave one token of output
        fix = (f"at most {room} visual tokens fit: lower fps or max_pixels, or send a shorter clip" if visual and room > 0
               else "shorten text_input")
        raise InvalidInput(f"prompt too long: its {n} tokens ({counts}) leave no room for output within "
                           f"max_model_len {max_model_len} ({fix})")


def build_prompt(tokenizer, text: str, media: list[tuple[str, tuple[int, int, int], float]]) -> Prompt:
    """Apply the model's chat template to one user turn (images, then videos, then ``text``) and expand
    each ``<|image_pad|>``/``<|video_pad|>`` to the item's visual-token count.

    ``media``: (kind, grid_thw in patches, second_per_grid_t in seconds; 0 for images), in prompt order.
    """
    content = [{"type": kind} for kind, _, _ in media] + [{"type": "text", "text": USER_TEXT}]
    templated = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                              add_generation_prompt=True)
    before, after = templated.split(USER_TEXT)
    # The user's text is tokenized on its own with special-token strings split into plain text, so a
    # prompt cannot inject "<|im_end|>" or a "<|video_pad|>" that no media backs.
    with _ENCODE_LOCK:
        ids = (tokenizer.encode(before, add_special_tokens=False)
               + tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
               + tokenizer.encode(after, add_special_tokens=False))
    pad_ids = {"image": tokenizer.convert_tokens_to_ids("<|image_pad|>"),
               "video": tokenizer.convert_tokens_to_ids("<|video_pad|>")}
    out: list[int] = []
    layouts: list[MediaLayout] = []
    pending = list(media)
    for token in ids:
        if pending and token == pad_ids[pending[0][0]]:
            kind, grid, spg = pending.pop(0)
            layout = MediaLayout(kind, tuple(grid), float(spg), len(out))
            layouts.append(layout)
            out.extend([token] * layout.num_tokens)
        else:
            out.append(token)
    if pending:
        raise RuntimeError(f"the chat template dropped {len(pending)} media placeholders")
    return Prompt(tuple(out), tuple(layouts))
