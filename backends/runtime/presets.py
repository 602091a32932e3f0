"""Architecture presets for dummy-weight runs: ``tiny`` (CPU tests) and ``qwen2_5_vl_7b`` (full size).

A checkpoint (``model_path``) brings its own config; presets are for runs without one (seeded random weights).
"""
from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase, Qwen2_5_VLConfig

from backends.runtime.tokenizer import special_token_ids

# Each preset: text_config and vision_config keyword arguments of Qwen2_5_VLConfig, plus "dtype".
# vocab_size None means "the tokenizer's length" (the offline tokenizer has ~280 tokens).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "dtype": "float32",
        "text_config": {
            # head_dim 64 (128 / 2 heads): the smallest flashinfer builds kernels for, so the GPU tests can
            # compare its backend with torch's on this model; GQA group 2.
            "vocab_size": None, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                                      "mrope_section": [8, 12, 12]},
            # Random weights at the library's 0.02 give greedy steps whose top-2 logit gap is a few 1e-4
            # (about 2% of steps below 1e-3, median 0.07), close to float rounding; at 0.2 no gap below
            # 7e-3 was seen in 96 steps (median 0.4), so token-level comparisons with generate() hold.
            "initializer_range": 0.2,
        },
        "vision_config": {
            "depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 128,
            "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 112,
            "fullatt_block_indexes": [1], "tokens_per_second": 2, "in_channels": 3, "initializer_range": 0.2,
        },
    },
    # Qwen/Qwen2.5-VL-7B-Instruct's published config.json.
    "qwen2_5_vl_7b": {
        "dtype": "bfloat16",
        "text_config": {
            "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
            "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 128000,
            "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                                      "mrope_section": [16, 24, 24]},
            "initializer_range": 0.02, "hidden_act": "silu", "use_sliding_window": False,
            "sliding_window": 32768, "max_window_layers": 28,
        },
        "vision_config": {
            "depth": 32, "hidden_size": 1280, "num_heads": 16, "intermediate_size": 3420, "out_hidden_size": 3584,
            "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "in_channels": 3,
            "hidden_act": "silu", "initializer_range": 0.02,
        },
    },
}


def build_config(preset: str, tokenizer: PreTrainedTokenizerBase) -> Qwen2_5_VLConfig:
    """The ``Qwen2_5_VLConfig`` of ``preset`` with token ids taken from ``tokenizer``.

    Image/video/vision-start/end ids, bos/pad (``<|endoftext|>``) and eos (``<|im_end|>``) come from the
    tokenizer, so the offline tokenizer and a real Qwen tokenizer both fit. ``config.dtype`` is the
    preset's dtype name. Raises ValueError for an unknown preset and when the tokenizer has more tokens
    than a fixed ``vocab_size``.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    spec = PRESETS[preset]
    ids = special_token_ids(tokenizer)
    text = dict(spec["text_config"], rope_parameters=dict(spec["text_config"]["rope_parameters"]))
    if text["vocab_size"] is None:
        text["vocab_size"] = len(tokenizer)
    elif len(tokenizer) > text["vocab_size"]:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but preset {preset!r} "
                         f"has vocab_size {text['vocab_size']}")
    text.update(bos_token_id=ids["endoftext"], pad_token_id=ids["endoftext"], eos_token_id=ids["im_end"])
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=dict(spec["vision_config"]),
        image_token_id=ids["image_pad"],
        video_token_id=ids["video_pad"],
        vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"],
        tie_word_embeddings=False,
        dtype=spec["dtype"],
    )
