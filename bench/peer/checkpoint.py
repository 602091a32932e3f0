"""A checkpoint directory without weights, loaded by both systems of the peer benchmark: Qwen2.5-VL-7B (the default)
or InternVL3-8B / -38B in the layout of their ``-hf`` checkpoints.

    python3 -m bench.peer.checkpoint /tmp/peer/qwen2_5_vl_7b_dummy
    python3 -m bench.peer.checkpoint /tmp/peer/internvl3_38b_dummy --preset internvl3_38b

vLLM loads it with ``--load-format dummy``; UnifiedServe with ``--model DIR --set '*.load_format=dummy'`` (its
loader then takes the architecture from ``config.json`` and draws random weights, and the orchestrator reads the
tokenizer and chat template from the directory). What it holds:

* ``config.json``: the ``backends.runtime.presets`` preset as its family's transformers config
  (``backends.runtime.families.registry.build_config``), with ``architectures`` (the family's model class) set
  for vLLM's model registry;
* the tokenizer (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``): the project's offline
  byte-level BPE (``backends.runtime.tokenizer.build_offline_tokenizer``) with the family's special tokens and chat
  template over a model vocabulary of exactly ids 0..151642, so that the special tokens take their real ids:
  Qwen2.5-VL's 14 at 151643..151656; InternVL3's 32 at 151643..151674 (``<IMG_CONTEXT>`` 151667, ``<video>``
  151674), with the named tokens ``InternVLProcessor`` reads (``start_image_token``, ``video_token``, ...);
* the processor (``processor_config.json``, and ``preprocessor_config.json`` / ``video_preprocessor_config.json``
  for readers of the older single-file layout), set as UnifiedServe's media rules are, so that both systems count
  the same visual tokens:

  - Qwen2.5-VL: qwen-vl-utils' pixel caps (images 4..16384 tokens' worth of pixels; video frames 128..768, at
    2 fps, 4..768 frames) with transformers 5.17's ``cap_pixels_per_frame`` on, so that its video processor bounds
    each frame by an even share of the 128,000-token budget as qwen-vl-utils (and UnifiedServe's
    ``flashcodec.sampling.plan_video``) do;
  - InternVL3: ``GotOcr2ImageProcessor`` with ``crop_to_patches`` (448-px tiles, 1..12 of them by aspect ratio and
    a thumbnail) and ``InternVLVideoProcessor`` (one 448-px tile a frame, ``do_sample_frames`` off: vLLM's video
    loader samples the frames, as many as its ``--media-io-kwargs`` say), from ``flashcodec.families.internvl3``'s
    ``InternVL3Config``.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from transformers import (GotOcr2ImageProcessor, InternVLProcessor, InternVLVideoProcessor, PreTrainedTokenizerFast,
                          ProcessorMixin, Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor)

from backends.runtime.families.registry import FAMILIES, build_config
from backends.runtime.presets import preset_family
from backends.runtime.tokenizer import build_offline_tokenizer
from flashcodec.families import family as media_family
from flashcodec.families.internvl3 import CONTEXT, END_IMAGE, START_IMAGE, VIDEO
from flashcodec.sampling import (FPS, IMAGE_MAX_PIXELS, IMAGE_MIN_PIXELS, VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS)

PRESET = "qwen2_5_vl_7b"
QWEN_MODEL_VOCAB = 151643  # ids 0..151642 are Qwen2's byte-level BPE vocabulary; <|endoftext|> is 151643
VIDEO_MAX_TOKENS = 128000  # qwen-vl-utils' MODEL_SEQ_LEN: its total video pixel budget is 90% of this many tokens
# InternVL's -hf tokenizers name their image tokens for InternVLProcessor (transformers' convert_internvl_weights_to_hf)
INTERNVL_NAMED_TOKENS = {"start_image_token": START_IMAGE, "end_image_token": END_IMAGE,
                         "context_image_token": CONTEXT, "video_token": VIDEO}
# Tokens past the language model's vocabulary: InternVL's "<video>" (151674 of a 151,674-token model), which its
# processor replaces by frames before the model sees it; config.json's token ids are read without them.
PROCESSOR_ONLY_TOKENS = (VIDEO,)


def checkpoint_tokenizer(preset: str, model_vocab_only: bool = False) -> PreTrainedTokenizerFast:
    """``preset``'s family's offline tokenizer over Qwen's model vocabulary (special tokens at their real ids),
    InternVL3's with its named image tokens; with ``model_vocab_only``, without the trailing
    ``PROCESSOR_ONLY_TOKENS`` and names (the ids ``config.json`` is built from). Raises ValueError for an unknown
    preset."""
    family = FAMILIES[preset_family(preset)]
    tokens = family.special_tokens
    while model_vocab_only and tokens[-1] in PROCESSOR_ONLY_TOKENS:
        tokens = tokens[:-1]
    tokenizer = build_offline_tokenizer(QWEN_MODEL_VOCAB, tokens, family.chat_template)
    if family.name != "internvl3" or model_vocab_only:
        return tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, eos_token=tokenizer.eos_token,
                                   pad_token=tokenizer.pad_token, chat_template=tokenizer.chat_template,
                                   model_max_length=tokenizer.model_max_length,
                                   extra_special_tokens=INTERNVL_NAMED_TOKENS)


def build_processor(preset: str = PRESET) -> ProcessorMixin:
    """``preset``'s processor over :func:`checkpoint_tokenizer`, set as the module docstring says. Raises ValueError
    for an unknown preset."""
    tokenizer = checkpoint_tokenizer(preset)
    if preset_family(preset) == "internvl3":
        c = media_family("internvl3").config
        common = dict(size={"height": c.tile_size, "width": c.tile_size}, image_mean=list(c.mean),
                      image_std=list(c.std))
        images = GotOcr2ImageProcessor(**common, crop_to_patches=True, min_patches=c.min_tiles,
                                       max_patches=c.max_tiles)
        videos = InternVLVideoProcessor(**common, do_sample_frames=False, initial_shift=True)
        return InternVLProcessor(image_processor=images, video_processor=videos, tokenizer=tokenizer,
                                 chat_template=tokenizer.chat_template, image_seq_length=c.tokens_per_tile)
    images = Qwen2VLImageProcessor(min_pixels=IMAGE_MIN_PIXELS, max_pixels=IMAGE_MAX_PIXELS)
    videos = Qwen2VLVideoProcessor(min_pixels=VIDEO_MIN_PIXELS, max_pixels=VIDEO_MAX_PIXELS, fps=FPS,
                                   do_sample_frames=True, cap_pixels_per_frame=True,
                                   max_video_tokens=VIDEO_MAX_TOKENS)
    return Qwen2_5_VLProcessor(image_processor=images, video_processor=videos, tokenizer=tokenizer,
                               chat_template=tokenizer.chat_template)


def write_checkpoint(path: Path, preset: str = PRESET) -> Path:
    """Write ``preset``'s directory at ``path`` (created if missing; files already there are replaced) and return
    it. No weights. Raises ValueError for an unknown preset."""
    path.mkdir(parents=True, exist_ok=True)
    processor = build_processor(preset)
    processor.save_pretrained(path)
    processor.image_processor.save_pretrained(path)
    processor.video_processor.save_pretrained(path)
    config = build_config(preset, checkpoint_tokenizer(preset, model_vocab_only=True))
    config.architectures = [FAMILIES[preset_family(preset)].model_class.__name__]
    config.save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="the directory to write")
    parser.add_argument("--preset", default=PRESET, help="qwen2_5_vl_7b, internvl3_8b or internvl3_38b")
    args = parser.parse_args()
    print(write_checkpoint(args.path, args.preset))


if __name__ == "__main__":
    main()
