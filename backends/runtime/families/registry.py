"""The families by name and by config: the one place that lists them."""
from __future__ import annotations

from transformers import AutoConfig, PreTrainedConfig, PreTrainedTokenizerFast

from backends.runtime.families import FAMILY_OF_MODEL_TYPE
from backends.runtime.families.base import ModelFamily
from backends.runtime.families.internvl3 import InternVL3
from backends.runtime.families.qwen2_5_vl import Qwen2_5_VL
from backends.runtime.presets import PRESETS, preset_family
from backends.runtime.tokenizer import build_offline_tokenizer, load_tokenizer

FAMILIES: dict[str, ModelFamily] = {family.name: family for family in (Qwen2_5_VL(), InternVL3())}
assert {FAMILIES[name].model_type: name for name in FAMILIES} == FAMILY_OF_MODEL_TYPE


def family_for(config: PreTrainedConfig) -> ModelFamily:
    """The family of a model's config (its ``model_type``). Raises ValueError for a model_type of no family."""
    name = FAMILY_OF_MODEL_TYPE.get(config.model_type)
    if name is None:
        raise ValueError(f"model_type {config.model_type!r} is not served (one of {sorted(FAMILY_OF_MODEL_TYPE)})")
    return FAMILIES[name]


def offline_tokenizer(preset: str) -> PreTrainedTokenizerFast:
    """The offline tokenizer of ``preset``'s family (``tokenizer.build_offline_tokenizer`` with the family's special
    tokens and chat template). Raises ValueError for an unknown preset."""
    family = FAMILIES[preset_family(preset)]
    return build_offline_tokenizer(special_tokens=family.special_tokens, chat_template=family.chat_template)


def model_tokenizer(preset: str, model_path: str | None) -> PreTrainedTokenizerFast:
    """The served model's tokenizer: the checkpoint's (``tokenizer.load_tokenizer``) when ``model_path`` is given,
    else ``preset``'s family's offline one (:func:`offline_tokenizer`). Raises as they do."""
    return load_tokenizer(model_path) if model_path is not None else offline_tokenizer(preset)


def sampled_ids(preset: str, model_path: str | None, tokenizer: PreTrainedTokenizerFast) -> int:
    """How many token ids a request may name (its ``stop_token_ids``): the ids both the tokenizer knows and the
    model has logits for, ``min(len(tokenizer), vocab_size)``; ``vocab_size`` from the checkpoint's ``config.json``
    (text config) or the preset's. They differ both ways: Qwen2.5-VL-7B pads its logits to 152,064 rows past its
    151,665 tokens, and an InternVL3-hf tokenizer's ``<video>`` (151,674) has no logit row. Raises as the config
    reads do."""
    return min(len(tokenizer), model_config(preset, model_path, tokenizer).get_text_config().vocab_size)


def model_config(preset: str, model_path: str | None, tokenizer: PreTrainedTokenizerFast) -> PreTrainedConfig:
    """The served model's config: the checkpoint's ``config.json`` when ``model_path`` is given, else ``preset``'s
    (:func:`build_config`). Raises as they do."""
    if model_path is not None:
        return AutoConfig.from_pretrained(model_path, local_files_only=True)
    return build_config(preset, tokenizer)


def build_config(preset: str, tokenizer: PreTrainedTokenizerFast) -> PreTrainedConfig:
    """The transformers config of ``preset`` (its family's ``build_config``) with token ids taken from ``tokenizer``;
    ``config.dtype`` is the preset's dtype name. Raises ValueError for an unknown preset and when the tokenizer has
    more tokens than a fixed ``vocab_size``."""
    return FAMILIES[preset_family(preset)].build_config(PRESETS[preset], tokenizer)
