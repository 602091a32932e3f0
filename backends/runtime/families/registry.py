"""The families' runtime parts by name and by config: the one place that lists them (their torch-free side:
``flashcodec.families``)."""
from __future__ import annotations

import copy

from transformers import CONFIG_MAPPING, PreTrainedConfig, PreTrainedTokenizerFast

from backends.runtime.families import ServedModel
from backends.runtime.families.base import ModelFamily
from backends.runtime.families.internvl3 import InternVL3
from backends.runtime.families.qwen2_5_vl import Qwen2_5_VL
from backends.runtime.presets import PRESETS, preset_family
from backends.runtime.tokenizer import build_offline_tokenizer, load_tokenizer
from flashcodec.families import family_for_model_type

FAMILIES: dict[str, ModelFamily] = {family.name: family for family in (Qwen2_5_VL(), InternVL3())}


def family_for(config: PreTrainedConfig) -> ModelFamily:
    """The family of a model's config (its ``model_type``, ``flashcodec.families.family_for_model_type``). Raises
    ValueError for a model_type of no family."""
    return FAMILIES[family_for_model_type(config.model_type).name]


def offline_tokenizer(preset: str) -> PreTrainedTokenizerFast:
    """The offline tokenizer of ``preset``'s family (``tokenizer.build_offline_tokenizer`` with the family's special
    tokens and chat template). Raises ValueError for an unknown preset."""
    family = FAMILIES[preset_family(preset)]
    return build_offline_tokenizer(special_tokens=family.special_tokens, chat_template=family.chat_template)


def model_tokenizer(model: ServedModel) -> PreTrainedTokenizerFast:
    """The served model's tokenizer: its checkpoint's (``tokenizer.load_tokenizer``, given the config already read)
    when it has one, else its preset's family's offline one (:func:`offline_tokenizer`). Raises as they do."""
    if model.config is None:
        return offline_tokenizer(model.preset)
    return load_tokenizer(model.model_path, _checkpoint_config(model))


def sampled_ids(model: ServedModel, tokenizer: PreTrainedTokenizerFast) -> int:
    """How many token ids a request may name (its ``stop_token_ids``): the ids both the tokenizer knows and the
    model has logits for, ``min(len(tokenizer), vocab_size)``; ``vocab_size`` from the checkpoint's ``config.json``
    (text config) or the preset's. They differ both ways: Qwen2.5-VL-7B pads its logits to 152,064 rows past its
    151,665 tokens, and an InternVL3-hf tokenizer's ``<video>`` (151,674) has no logit row. Raises as the config
    reads do."""
    return min(len(tokenizer), model_config(model, tokenizer).get_text_config().vocab_size)


def model_config(model: ServedModel, tokenizer: PreTrainedTokenizerFast) -> PreTrainedConfig:
    """The served model's config: its checkpoint's when it has one, else its preset's (:func:`build_config`, token
    ids from ``tokenizer``). Raises as :func:`build_config` does."""
    if model.config is not None:
        return _checkpoint_config(model)
    return build_config(model.preset, tokenizer)


def _checkpoint_config(model: ServedModel) -> PreTrainedConfig:
    """``model``'s config.json as ``ServedModel.read`` read it, made as ``AutoConfig.from_pretrained`` makes it (the
    config class of its ``model_type``, ``from_dict``), from a copy: a config may change the dicts it is given."""
    return CONFIG_MAPPING[model.config["model_type"]].from_dict(copy.deepcopy(model.config),
                                                                name_or_path=model.model_path)


def build_config(preset: str, tokenizer: PreTrainedTokenizerFast) -> PreTrainedConfig:
    """The transformers config of ``preset`` (its family's ``build_config``) with token ids taken from ``tokenizer``;
    ``config.dtype`` is the preset's dtype name. Raises ValueError for an unknown preset and when the tokenizer has
    more tokens than a fixed ``vocab_size``."""
    return FAMILIES[preset_family(preset)].build_config(PRESETS[preset], tokenizer)
