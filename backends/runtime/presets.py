"""Architecture presets for dummy-weight runs (data only, no torch): per family a CPU-test size and full sizes.

``tiny`` and ``qwen2_5_vl_7b`` are Qwen2.5-VL; ``internvl3_tiny``, ``internvl3_8b`` and ``internvl3_38b`` InternVL3.
A checkpoint (``model_path``) brings its own config; presets are for runs without one (seeded random weights). The
family's ``build_config`` (``families.registry.build_config``) turns a preset into a transformers config.
"""
from __future__ import annotations

from typing import Any

# What ModelSpec (``backends.runtime.loader``) loads; here, without torch, so that the launcher checks them too
# (``triton_io.CHOICES``).
LOAD_FORMATS = ("auto", "dummy")
DTYPES = ("auto", "float32", "float16", "bfloat16")

# The CPU-test language model of both tiny presets. head_dim 64 (128 / 2 heads): the smallest flashinfer builds
# kernels for, so the GPU tests can compare its backend with torch's on these models; GQA group 2. Random weights at
# the library's 0.02 give greedy steps whose top-2 logit gap is a few 1e-4 (about 2% of steps below 1e-3, median
# 0.07), close to float rounding; at 0.2 no gap below 7e-3 was seen in 96 steps (median 0.4), so token-level
# comparisons with generate() hold.
_TINY_TEXT = {
    "vocab_size": None, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "initializer_range": 0.2,
}
# Shared by the InternVL3 presets: InternViT's fields in OpenGVLab's internvl_custom2hf conversion tool (the
# vision_config of the InternVL3-*-hf checkpoints), and the Qwen2.5 language model's common fields.
_INTERNVIT = {
    "image_size": [448, 448], "patch_size": [14, 14], "num_channels": 3, "hidden_act": "gelu",
    "layer_norm_eps": 1e-6, "layer_scale_init_value": 0.1, "use_absolute_position_embeddings": True,
    "use_mask_token": False, "use_mean_pooling": True,
    "initializer_range": 0.02,  # the tool's 1e-10 would make dummy weights all but zero
}
_INTERNVIT_300M = dict(_INTERNVIT, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                       intermediate_size=4096, norm_type="layer_norm", attention_bias=True, use_qk_norm=False)
_INTERNVIT_6B = dict(_INTERNVIT, hidden_size=3200, num_hidden_layers=45, num_attention_heads=25,
                     intermediate_size=12800, norm_type="rms_norm", attention_bias=False, use_qk_norm=True)
_QWEN2_5_TEXT = {
    "vocab_size": 151674, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "initializer_range": 0.02,
    "use_sliding_window": False,
}


def _internvl3(vision_config: dict[str, Any], **text_config: Any) -> dict[str, Any]:
    """A full-size InternVL3 preset in bf16: ``vision_config`` and the Qwen2.5 language model's sizes."""
    return {"family": "internvl3", "dtype": "bfloat16", "text_config": dict(_QWEN2_5_TEXT, **text_config),
            "vision_config": vision_config}


# Each preset: its family, "dtype", and the text_config / vision_config keyword arguments of the family's config.
# vocab_size None means "the tokenizer's length" (the offline tokenizer has a few hundred tokens).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "family": "qwen2_5_vl",
        "dtype": "float32",
        "text_config": dict(_TINY_TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                                         "mrope_section": [8, 12, 12]}),
        "vision_config": {
            "depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 128,
            "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 112,
            "fullatt_block_indexes": [1], "tokens_per_second": 2, "in_channels": 3, "initializer_range": 0.2,
        },
    },
    # Qwen/Qwen2.5-VL-7B-Instruct's published config.json.
    "qwen2_5_vl_7b": {
        "family": "qwen2_5_vl",
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
    # InternVL3 at CPU-test size: the tiny language model (as Qwen2) under a two-layer InternViT of 448-pixel tiles
    # (256 tokens a tile) with the 6B tower's RMSNorm and q/k norms, so the CPU tests run the path of internvl3_38b.
    "internvl3_tiny": {
        "family": "internvl3",
        "dtype": "float32",
        "text_config": dict(_TINY_TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                            use_sliding_window=False),
        "vision_config": dict(_INTERNVIT_6B, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=64, initializer_range=0.2),
    },
    # OpenGVLab/InternVL3-8B-hf: InternViT-300M-448px-V2_5 (OpenGVLab's internvl_custom2hf conversion tool,
    # vit_300m_config) and Qwen2.5-7B's language model with InternVL's 151674-token vocabulary (InternVL3-8B's
    # llm_config; Qwen2.5-7B's config.json).
    "internvl3_8b": _internvl3(_INTERNVIT_300M, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                               num_attention_heads=28, num_key_value_heads=4),
    # OpenGVLab/InternVL3-38B-hf: InternViT-6B-448px-V2_5 (the conversion tool's vit_6b_config) and Qwen2.5-32B's
    # language model (its config.json) with InternVL's vocabulary.
    "internvl3_38b": _internvl3(_INTERNVIT_6B, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                                num_attention_heads=40, num_key_value_heads=8),
}


def preset_family(preset: str) -> str:
    """The family name of ``preset``. Raises ValueError for an unknown preset."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[preset]["family"]
