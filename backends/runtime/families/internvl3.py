"""InternVL3 (transformers' ``InternVLForConditionalGeneration``, HF-format checkpoints such as
OpenGVLab/InternVL3-8B-hf): its runtime parts.

Vision: InternViT (``model.model.vision_tower``) on 448x448 tiles, then transformers' own
``InternVLModel.get_image_features`` steps: drop the CLS token, pixel shuffle 0.5 (2x2 patches -> one token,
so 256 tokens a tile), the MLP projector (``model.model.multi_modal_projector``). A tile is encoded on its own, so a
step may encode any subset of an image's or a video's tiles. An item is ``(pixel_values, grid_thw)``:
float ``[t, 3, h*14, w*14]`` tiles (transformers' ``pixel_values``: an image's tiles, thumbnail last, or one tile per
video frame) and ``grid_thw = (t, h, w)`` in patches (``(t, 32, 32)`` for 448-pixel tiles). Images and video frames
both use ``<IMG_CONTEXT>`` (``config.image_token_id``). Positions: the Qwen2 language model's plain 1-D RoPE,
``arange(L)``; decode continues at the prompt length (delta 0), as ``generate()`` does.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn
from transformers import InternVLConfig, InternVLForConditionalGeneration, PreTrainedConfig, PreTrainedTokenizerBase
from transformers.models.internvl.modeling_internvl import InternVLModel

from backends.runtime.families.base import ModelFamily, VisionItem, text_config_with_token_ids
from flashcodec.families.internvl3_pixels import tiles_from_rows
from backends.runtime.tokenizer import SPECIAL_TOKENS

# After Qwen2.5-VL's 14: Qwen2.5's other added tokens (ids 151657..151664), then InternVL's (151665..151673:
# <IMG_CONTEXT> is 151667, InternVLConfig's default image_token_id), then "<video>", which the InternVL processor
# expands into frames before the model sees it (OpenGVLab's internvl_custom2hf conversion adds it last).
INTERNVL_TOKENS = (*SPECIAL_TOKENS, "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
                   "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<img>", "</img>",
                   "<IMG_CONTEXT>", "<quad>", "</quad>", "<ref>", "</ref>", "<box>", "</box>", "<video>")
IMAGE_CONTEXT = "<IMG_CONTEXT>"

# The chat template of the InternVL3-*-hf checkpoints (as OpenGVLab's internvl_custom2hf conversion writes it): no
# default system turn; an image is "<IMG_CONTEXT>\n", a video "<video>\n", both expanded by the processor.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class InternVLVision(nn.Module):
    """InternViT and the projector of one model as one module: ``forward`` is transformers'
    ``InternVLModel.get_image_features`` (``pooler_output``) on the same submodules, so it can be copied to another
    device (data parallel) without the language model. ``pixel_values`` float ``[tiles, 3, H, W]`` (square tiles)
    -> ``[tiles, H*W / (14*14*4), text hidden]`` in the module's dtype."""

    get_image_features = InternVLModel.get_image_features
    pixel_shuffle = InternVLModel.pixel_shuffle

    def __init__(self, model: InternVLForConditionalGeneration) -> None:
        super().__init__()
        self.config = model.config
        self.vision_tower = model.model.vision_tower
        self.multi_modal_projector = model.model.multi_modal_projector

    @property
    def dtype(self) -> torch.dtype:
        """What ``get_image_features`` casts the pixels to."""
        return self.multi_modal_projector.linear_1.weight.dtype

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.get_image_features(pixel_values, return_dict=True).pooler_output


class InternVL3(ModelFamily):
    """InternVL3: 1-D RoPE, tiles as vision inputs, pixel shuffle 0.5 (four patches a token)."""

    name = "internvl3"
    model_class = InternVLForConditionalGeneration
    vision_prefixes = ("model.vision_tower.", "model.multi_modal_projector.")
    position_rows = 1
    special_tokens = INTERNVL_TOKENS
    chat_template = CHAT_TEMPLATE

    def build_config(self, preset: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> InternVLConfig:
        """``image_token_id`` is the tokenizer's ``<IMG_CONTEXT>``; bos/pad/eos as Qwen2.5's; embeddings untied
        (InternVL3-8B and -38B untie them). Raises as the base class says."""
        vocab = tokenizer.get_vocab()
        if IMAGE_CONTEXT not in vocab:
            raise KeyError(f"tokenizer has no special token {IMAGE_CONTEXT}")
        text = dict(text_config_with_token_ids(preset["text_config"], tokenizer), model_type="qwen2",
                    tie_word_embeddings=False)
        return InternVLConfig(
            text_config=text,
            vision_config=dict(preset["vision_config"]),
            image_token_id=vocab[IMAGE_CONTEXT],
            downsample_ratio=0.5,
            projector_hidden_act="gelu",
            vision_feature_layer=-1,
            vision_feature_select_strategy="default",
            tie_word_embeddings=False,
            dtype=preset["dtype"],
        )

    def vision_encoder(self, model: InternVLForConditionalGeneration) -> nn.Module:
        return InternVLVision(model)

    def prepare_vision(self, encoder: nn.Module) -> None:
        """Nothing to do: every tile is one sequence of 1 + h*w tokens, which transformers' SDPA attention runs as one
        batch, and InternViT's MLP widths (4096, 12800) are aligned already."""

    def compile_vision(self, encoder: nn.Module) -> None:
        for layer in encoder.vision_tower.encoder.layer:
            layer.compile(dynamic=True)
        encoder.multi_modal_projector.compile(dynamic=True)

    def check_pixels(self, config: PreTrainedConfig, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]
                     ) -> None:
        """Tiles: float ``[t, channels, h*patch, w*patch]``, square (``h == w``: ``get_image_features`` reshapes to a
        square grid), ``h`` even (pixel shuffle 0.5)."""
        t, h, w = grid_thw
        vision = config.vision_config
        patch_h, patch_w = vision.patch_size
        want = (t, vision.num_channels, h * patch_h, w * patch_w)
        if tuple(pixel_values.shape) != want or h != w or h % 2:
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} do not fit grid_thw {grid_thw} "
                             f"(need {list(want)}, square tiles with an even patch count)")

    def pixels_from_patch_rows(self, config: PreTrainedConfig, rows: torch.Tensor, grid_thw: tuple[int, int, int]
                               ) -> torch.Tensor:
        """The pool holds a group's tiles as FlashCodec writes them: ``[t*h*w, channels*patch*patch]`` rows (588 for
        14-pixel patches), tile by tile, patches in raster order, each ``(C, p, p)``
        (``flashcodec.families.internvl3_pixels.tile_rows``); ``tiles_from_rows`` folds them back into
        ``[t, C, h*patch, w*patch]`` tiles (a copy)."""
        t, h, w = grid_thw
        vision = config.vision_config
        if rows.shape[0] != t * h * w or h != w:
            raise ValueError(f"{tuple(rows.shape)} patch-pool rows do not hold the tiles of grid_thw {grid_thw}")
        return tiles_from_rows(rows, t, vision.num_channels, vision.patch_size[0])

    def encode_batch(self, encoder: nn.Module, items: Sequence[VisionItem]) -> list[torch.Tensor]:
        """The items' tiles in one forward per tile size; each item's ``[t, h*w/4, hidden]`` flattened in tile
        order, as transformers scatters them into the prompt."""
        weight = next(encoder.parameters())
        out: list[torch.Tensor | None] = [None] * len(items)
        for size in sorted({grid[1] for _, grid in items}):
            indices = [i for i, (_, grid) in enumerate(items) if grid[1] == size]
            tiles = torch.cat([items[i][0].to(weight.device, weight.dtype) for i in indices])
            embeds = encoder(tiles)
            for i, part in zip(indices, embeds.split([items[i][1][0] for i in indices])):
                out[i] = part.reshape(-1, part.shape[-1])
        return out

    def prompt_positions(self, config: PreTrainedConfig, input_ids: Sequence[int] | torch.Tensor,
                         image_grid_thw: Sequence[tuple[int, int, int]] = (),
                         video_grid_thw: Sequence[tuple[int, int, int]] = (),
                         second_per_grid_ts: Sequence[float] = ()) -> tuple[torch.Tensor, int]:
        """``arange(L)`` as ``[1, L]`` and delta 0 (transformers' Qwen2 positions: ``cache_position``); the
        ``<IMG_CONTEXT>`` tokens must number ``t*h*w/4`` per image and video. ``second_per_grid_ts`` does not move
        1-D positions but must still match the videos."""
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        found = int((ids == config.image_token_id).sum())
        grids = [*image_grid_thw, *video_grid_thw]
        expected = sum(t * h * w // 4 for t, h, w in grids)
        if found != expected:
            raise ValueError(f"prompt has {found} pad tokens of id {config.image_token_id} but its grids {grids} "
                             f"need {expected}")
        if len(second_per_grid_ts) != len(video_grid_thw):
            raise ValueError(f"{len(video_grid_thw)} videos but {len(second_per_grid_ts)} second_per_grid_ts values")
        return torch.arange(len(ids)).unsqueeze(0), 0

    def rotary_position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """``[1, T]`` is already ``Qwen2RotaryEmbedding``'s ``[batch, tokens]``."""
        return positions
