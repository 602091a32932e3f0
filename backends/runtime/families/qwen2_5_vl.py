"""Qwen2.5-VL (transformers' ``Qwen2_5_VLForConditionalGeneration``): its runtime parts.

Vision: ``model.model.visual`` on patch rows ``[t*h*w, 1176]`` with their ``grid_thw`` (the processor's order),
made fast by ``backends.runtime.vision`` (varlen window attention, padded MLP, compiled blocks); positions:
M-RoPE via transformers' ``get_rope_index`` (``language_model.mrope``).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn
from transformers import PreTrainedConfig, PreTrainedTokenizerBase, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from backends.runtime.families.base import ModelFamily, VisionItem, text_config_with_token_ids
from backends.runtime.language_model.mrope import mrope_positions
from backends.runtime.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, special_token_ids
from backends.runtime.vision.attention import use_varlen_vision_attention
from backends.runtime.vision.batch import encode_batch
from backends.runtime.vision.graphs import VisionGraphs
from backends.runtime.vision.speed import compile_vision_blocks, pad_vision_mlp
from backends.runtime.vision.tensor_parallel import check_towers


class Qwen2_5_VL(ModelFamily):
    """Qwen2.5-VL: 3-D M-RoPE positions, patch-row vision inputs, a tower that can be split over GPUs."""

    name = "qwen2_5_vl"
    model_class = Qwen2_5_VLForConditionalGeneration
    vision_prefixes = ("model.visual.",)
    position_rows = 3
    special_tokens = tuple(SPECIAL_TOKENS)
    chat_template = CHAT_TEMPLATE
    graphed_vision = True

    def build_config(self, preset: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> Qwen2_5_VLConfig:
        """Image/video/vision-start/end ids, bos/pad (``<|endoftext|>``) and eos (``<|im_end|>``) come from the
        tokenizer, so the offline tokenizer and a real Qwen tokenizer both fit. Raises as the base class says."""
        ids = special_token_ids(tokenizer)
        return Qwen2_5_VLConfig(
            text_config=text_config_with_token_ids(preset["text_config"], tokenizer),
            vision_config=dict(preset["vision_config"]),
            image_token_id=ids["image_pad"],
            video_token_id=ids["video_pad"],
            vision_start_token_id=ids["vision_start"],
            vision_end_token_id=ids["vision_end"],
            tie_word_embeddings=False,
            dtype=preset["dtype"],
        )

    def vision_encoder(self, model: Qwen2_5_VLForConditionalGeneration) -> nn.Module:
        return model.model.visual

    def prepare_vision(self, encoder: nn.Module) -> None:
        use_varlen_vision_attention(encoder)
        pad_vision_mlp(encoder)

    def compile_vision(self, encoder: nn.Module) -> None:
        compile_vision_blocks(encoder)

    def vision_graphs(self, encoder: nn.Module) -> VisionGraphs:
        """``backends.runtime.vision.graphs``: one graph per item grid, captured as grids recur."""
        return VisionGraphs(encoder)

    def check_pixels(self, config: PreTrainedConfig, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]
                     ) -> None:
        """Patch rows: float ``[t*h*w, C*temporal_patch*patch*patch]`` (1176), ``h`` and ``w`` divisible by the
        spatial merge size."""
        t, h, w = grid_thw
        merge = config.vision_config.spatial_merge_size
        if pixel_values.dim() != 2 or pixel_values.shape[0] != t * h * w or h % merge or w % merge:
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} do not fit grid_thw {grid_thw} "
                             f"(need t*h*w rows and h, w divisible by {merge})")

    def pixels_from_patch_rows(self, config: PreTrainedConfig, rows: torch.Tensor, grid_thw: tuple[int, int, int]
                               ) -> torch.Tensor:
        """The pool's rows are the patch rows themselves (``flashcodec.preprocess``); :meth:`check_pixels` checks
        their count."""
        return rows

    def encode_batch(self, encoder: nn.Module, items: Sequence[VisionItem]) -> list[torch.Tensor]:
        return encode_batch(encoder, items)

    def prompt_positions(self, config: PreTrainedConfig, input_ids: Sequence[int] | torch.Tensor,
                         image_grid_thw: Sequence[tuple[int, int, int]] = (),
                         video_grid_thw: Sequence[tuple[int, int, int]] = (),
                         second_per_grid_ts: Sequence[float] = ()) -> tuple[torch.Tensor, int]:
        """M-RoPE positions ``[3, L]`` and delta: ``language_model.mrope.mrope_positions``."""
        return mrope_positions(config, input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts)

    def rotary_position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """``[3, T]`` -> ``[3, 1, T]`` (``Qwen2_5_VLRotaryEmbedding``: axes, batch, tokens)."""
        return positions.unsqueeze(1)

    def check_vision_tensor_parallel(self, config: PreTrainedConfig, ranks: int, tp: int) -> None:
        check_towers(ranks, tp, config.vision_config.num_heads)

