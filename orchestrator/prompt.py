"""The prompt: chat template, visual-token expansion, and where each temporal-patch group's tokens sit (or a text
prompt as it is, without the chat template).

The visual-token count of each item comes from metadata alone (flashcodec's probe + sampling plan),
before any frame is decoded: a group of grid (1, h, w) patches becomes ``h*w / merge**2`` tokens
(Qwen2.5-VL: ``merge_size`` 2, transformers' ``Qwen2VLImageProcessor``).
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass

from orchestrator.messages import Part, Turn, user_turn
from orchestrator.sampling_params import InvalidInput

MERGE = 2  # spatial_merge_size of Qwen2.5-VL's vision tower
# Stands for message text k while the template is applied (NUL bytes: no template writes them).
_TEXT_MARK = "\x00unifiedserve-text-{}\x00"
_TEXT_MARK_RE = re.compile("\x00unifiedserve-text-(\\d+)\x00")
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
        video = any(m.kind == "video" for m in self.media)
        knobs = "fps or max_pixels" if video else "max_pixels"
        fewer_visual = f" (lower {knobs} for fewer visual tokens)" if visual else ""
        if n < max_model_len:
            raise InvalidInput(
                f"sampling_parameters: max_tokens {max_tokens} plus the prompt's {n} tokens ({counts}) exceeds "
                f"max_model_len {max_model_len}: max_tokens can be at most {max_model_len - n}{fewer_visual}")
        room = max_model_len - (n - visual) - 1  # visual tokens that would leave one token of output
        fewer = "lower fps or max_pixels, or send a shorter clip" if video else "lower max_pixels, or send fewer images"
        fix = f"at most {room} visual tokens fit: {fewer}" if visual and room > 0 else "shorten the prompt"
        raise InvalidInput(f"prompt too long: its {n} tokens ({counts}) leave no room for output within "
                           f"max_model_len {max_model_len} ({fix})")


def build_prompt(tokenizer, text: str, media: list[tuple[str, tuple[int, int, int], float]]) -> Prompt:
    """The prompt of one user turn: its images, then its videos, then ``text`` (the ``text_input`` request).

    ``media``: (kind, grid_thw in patches, second_per_grid_t in seconds; 0 for images), in prompt order.
    """
    return build_chat_prompt(tokenizer, (user_turn(text, [kind for kind, _, _ in media]),), media)


def build_chat_prompt(tokenizer, turns: tuple[Turn, ...], media: list[tuple[str, tuple[int, int, int], float]]
                      ) -> Prompt:
    """Apply the model's chat template to a conversation (then the assistant's turn) and expand each
    ``<|image_pad|>``/``<|video_pad|>`` to its item's visual-token count.

    ``media``: (kind, grid_thw in patches, second_per_grid_t in seconds; 0 for images), one per placeholder of
    ``turns``, in the same order. Raises RuntimeError when the template drops or repeats a text or a placeholder.
    """
    texts: list[str] = []

    def template_part(part: Part) -> dict:
        if part.kind != "text":
            return {"type": part.kind}
        texts.append(part.text)
        return {"type": "text", "text": _TEXT_MARK.format(len(texts) - 1)}

    conversation = [{"role": turn.role, "content": [template_part(p) for p in turn.parts]} for turn in turns]
    templated = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    pieces = _TEXT_MARK_RE.split(templated)  # template, text index, template, text index, ..., template
    if sorted(int(i) for i in pieces[1::2]) != list(range(len(texts))):
        raise RuntimeError("the chat template dropped or repeated a message's text")
    # Message texts are tokenized on their own with special-token strings split into plain text, so a
    # prompt cannot inject "<|im_end|>" or a "<|video_pad|>" that no media backs.
    ids: list[int] = []
    with _ENCODE_LOCK:
        for k, piece in enumerate(pieces):
            if k % 2:
                ids += tokenizer.encode(texts[int(piece)], add_special_tokens=False, split_special_tokens=True)
            else:
                ids += tokenizer.encode(piece, add_special_tokens=False)
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


# Qwen2.5-VL's vision tokens: only the server places them (with the visual tokens of a media item); M-RoPE's
# positions (transformers' get_rope_index) are read from them, so a prompt may not bring its own.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


def build_raw_prompt(tokenizer, text: str) -> Prompt:
    """A text prompt tokenized as it is, without the chat template (OpenAI's completions, the vLLM backend's
    ``text_input``): special tokens written in it (``<|im_start|>``) are special tokens, as in vLLM's completions
    (``add_special_tokens=True``, which adds nothing for Qwen's tokenizer). Raises InvalidInput when it holds one of
    :data:`VISION_TOKENS`."""
    with _ENCODE_LOCK:
        ids = tokenizer.encode(text, add_special_tokens=True)
    vision = dict(zip(tokenizer.convert_tokens_to_ids(list(VISION_TOKENS)), VISION_TOKENS))
    found = sorted({vision[i] for i in ids if i in vision})
    if found:
        raise InvalidInput(f"prompt: holds {', '.join(found)}, which only the server places (send images and videos "
                           "with text_input or messages)")
    return Prompt(tuple(ids), ())
