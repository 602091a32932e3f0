"""What the runtime needs to know of a model family: one subclass of :class:`ModelFamily` per family.

The stages and ``ModelRunner`` are model-agnostic; they look a model's family up by its config
(``families.registry.family_for``) and call it for what differs between families: the transformers class and
config, the offline tokenizer's special tokens and chat template, the vision side (which modules it is, how a batch
of pixel inputs becomes merged embeddings), and the language model's rotary positions (Qwen2.5-VL's 3-D M-RoPE,
InternVL3's 1-D RoPE). The language model itself is the same kind of module in every family (transformers'
Qwen2-style decoder at ``model.model.language_model``, ``model.lm_head``), so the paged attention, CUDA graphs,
shared weights and sampler are common.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from backends.runtime.tokenizer import special_token_ids

if TYPE_CHECKING:
    from backends.runtime.vision.graphs import VisionGraphs

# One item for the vision encoder: (pixel input in the family's layout, grid_thw (t, h, w) in patches).
VisionItem = tuple[torch.Tensor, tuple[int, int, int]]


class ModelFamily(ABC):
    """A model family's runtime parts (stateless; one instance per family in ``families.registry``).

    ``name``: the family's name in presets and in ``flashcodec.families``, whose ``Family`` of that name is its
    torch-free side (the checkpoints' ``model_type``, default budgets, media rules); ``model_class``: the
    transformers class built or loaded; ``vision_prefixes``: parameter-name prefixes of the vision side (all other
    parameters are the language model's, which ``backends.ipc.shared_weights`` shares between stages);
    ``position_rows``: rows of a prompt's positions (3 for M-RoPE, 1 for 1-D RoPE); ``special_tokens`` /
    ``chat_template``: what the offline tokenizer adds to its byte-level vocabulary
    (``tokenizer.build_offline_tokenizer``), in the checkpoint tokenizer's order; ``graphed_vision``: whether
    :meth:`vision_graphs` gives CUDA graphs of the vision tower.
    """

    name: str
    model_class: type[PreTrainedModel]
    vision_prefixes: tuple[str, ...]
    position_rows: int
    special_tokens: tuple[str, ...]
    chat_template: str
    graphed_vision: bool = False

    @abstractmethod
    def build_config(self, preset: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> PreTrainedConfig:
        """The family's config for a preset's ``text_config`` / ``vision_config`` / ``dtype`` entries, with token ids
        from ``tokenizer`` (``vocab_size`` None: the tokenizer's length). Raises ValueError when the tokenizer has
        more tokens than a fixed ``vocab_size``, KeyError when it lacks a special token."""

    @abstractmethod
    def vision_encoder(self, model: PreTrainedModel) -> nn.Module:
        """The module :meth:`encode_batch` runs (part of ``model``: it shares its parameters)."""

    @abstractmethod
    def prepare_vision(self, encoder: nn.Module) -> None:
        """Make ``encoder`` faster in place with the same output (attention kernels, aligned widths); once, before
        it is copied to other devices or split."""

    @abstractmethod
    def compile_vision(self, encoder: nn.Module) -> None:
        """``torch.compile`` the blocks of ``encoder`` (or of a copy or shard of it) in place, lazily (compiled by
        the first forward). Meant for CUDA: a CPU compile needs a C++ compiler."""

    @abstractmethod
    def check_pixels(self, config: PreTrainedConfig, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]
                     ) -> None:
        """Raises ValueError when ``pixel_values`` do not have the layout of ``grid_thw`` (the message names
        ``grid_thw``)."""

    @abstractmethod
    def pixels_from_patch_rows(self, config: PreTrainedConfig, rows: torch.Tensor, grid_thw: tuple[int, int, int]
                               ) -> torch.Tensor:
        """One group's rows of the shared patch pool (float ``[n, patch_dim]``, ``flashcodec.patch_pool.read_group``) as
        the pixel input of :meth:`check_pixels` for ``grid_thw`` (a view where it can be). Raises ValueError when
        the rows do not hold ``grid_thw``'s pixels."""

    @abstractmethod
    def encode_batch(self, encoder: nn.Module, items: Sequence[VisionItem]) -> list[torch.Tensor]:
        """Merged visual embeddings of each item in one forward, in order: ``[t*h*w / 4, text hidden]`` each, in
        the encoder's dtype, on its device (the pixels are moved there). Empty ``items``: an empty list."""

    @abstractmethod
    def prompt_positions(self, config: PreTrainedConfig, input_ids: Sequence[int] | torch.Tensor,
                         image_grid_thw: Sequence[tuple[int, int, int]] = (),
                         video_grid_thw: Sequence[tuple[int, int, int]] = (),
                         second_per_grid_ts: Sequence[float] = ()) -> tuple[torch.Tensor, int]:
        """Rotary positions of a whole prompt whose visual pad tokens are expanded (``t*h*w / 4`` per item), and the
        offset decode continues with. ``input_ids``: ints, or int64 ``[L]`` on the CPU (read, not copied). Returns
        int64 ``[position_rows, L]`` on the CPU and ``delta`` (token index ``p >= L`` has position ``p + delta``).
        Raises ValueError when the pad tokens do not match the grids or ``second_per_grid_ts`` does not match the
        videos."""

    @abstractmethod
    def rotary_position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """``positions`` int ``[position_rows, T]`` of one packed sequence -> the ``position_ids`` the language
        model's rotary module takes for a batch of one."""

    def vision_graphs(self, encoder: nn.Module) -> VisionGraphs:
        """CUDA graphs of ``encoder`` (prepared and compiled, on a CUDA device) per item grid, replayed by
        ``ModelRunner.encode_many``; :attr:`graphed_vision` says whether the family has them. By default it has
        none: raises ValueError."""
        raise ValueError(f"the {self.name} vision tower has no CUDA graphs")

    def check_vision_tensor_parallel(self, config: PreTrainedConfig, ranks: int, tp: int) -> None:
        """Raises ValueError unless the vision tower can be split over ``ranks`` GPUs in towers of ``tp``
        (``backends.runtime.vision.tensor_parallel``); by default a family's tower cannot be split at all."""
        raise ValueError(f"the {self.name} vision tower has no tensor-parallel split")


def text_config_with_token_ids(text: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """A preset's ``text_config`` with ``vocab_size`` (None: the tokenizer's length) checked against the tokenizer and
    bos/pad ``<|endoftext|>``, eos ``<|im_end|>`` (Qwen2.5's, as both families' tokenizers have them).
    Raises ValueError when the tokenizer has more tokens than a fixed ``vocab_size``."""
    ids = special_token_ids(tokenizer)
    text = dict(text, bos_token_id=ids["endoftext"], pad_token_id=ids["endoftext"], eos_token_id=ids["im_end"],
                rope_parameters=dict(text["rope_parameters"]))  # the config may change it: a copy, not the preset's
    if text["vocab_size"] is None:
        text["vocab_size"] = len(tokenizer)
    elif len(tokenizer) > text["vocab_size"]:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but the preset has vocab_size {text['vocab_size']}")
    return text
