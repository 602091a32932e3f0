"""A Qwen2.5-VL-7B checkpoint directory without weights, loaded by both systems of the peer benchmark.

    python3 -m bench.peer.checkpoint /tmp/peer/qwen2_5_vl_7b_dummy

vLLM loads it with ``--load-format dummy``; UnifiedServe with ``--model DIR --set '*.load_format=dummy'`` (its
loader then takes the architecture from ``config.json`` and draws random weights, and the orchestrator reads the
tokenizer and chat template from the directory). What it holds:

* ``config.json``: ``backends.runtime.presets`` "qwen2_5_vl_7b" (Qwen/Qwen2.5-VL-7B-Instruct's published config)
  as a transformers ``Qwen2_5_VLConfig``, with ``architectures`` set for vLLM's model registry;
* the tokenizer (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``): the project's offline
  byte-level BPE (``backends.runtime.tokenizer.build_offline_tokenizer``) with a model vocabulary of exactly
  ids 0..151642, so that Qwen's 14 special tokens take their real ids 151643..151656;
* the processor (``processor_config.json``, and ``preprocessor_config.json`` / ``video_preprocessor_config.json``
  for readers of the older single-file layout): Qwen2.5-VL's pixel caps (images 4..16384 tokens' worth of
  pixels; video frames 128..768, at 2 fps, 4..768 frames) with transformers 5.17's ``cap_pixels_per_frame`` on,
  so that its video processor bounds each frame by an even share of the 128,000-token budget as qwen-vl-utils
  (and UnifiedServe's ``flashcodec.sampling.plan_video``) do, and both systems count the same visual tokens.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

from backends.runtime.families.registry import build_config
from backends.runtime.tokenizer import CHAT_TEMPLATE, build_offline_tokenizer
from flashcodec.sampling import (FPS, IMAGE_MAX_PIXELS, IMAGE_MIN_PIXELS, VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS)

PRESET = "qwen2_5_vl_7b"
QWEN_MODEL_VOCAB = 151643  # ids 0..151642 are Qwen2's byte-level BPE vocabulary; <|endoftext|> is 151643
VIDEO_MAX_TOKENS = 128000  # qwen-vl-utils' MODEL_SEQ_LEN: its total video pixel budget is 90% of this many tokens


def build_processor() -> Qwen2_5_VLProcessor:
    """Qwen2.5-VL's processor over the padded offline tokenizer, with qwen-vl-utils' pixel and frame rules."""
    images = Qwen2VLImageProcessor(min_pixels=IMAGE_MIN_PIXELS, max_pixels=IMAGE_MAX_PIXELS)
    videos = Qwen2VLVideoProcessor(min_pixels=VIDEO_MIN_PIXELS, max_pixels=VIDEO_MAX_PIXELS, fps=FPS,
                                   do_sample_frames=True, cap_pixels_per_frame=True,
                                   max_video_tokens=VIDEO_MAX_TOKENS)
    return Qwen2_5_VLProcessor(image_processor=images, video_processor=videos,
                               tokenizer=build_offline_tokenizer(QWEN_MODEL_VOCAB), chat_template=CHAT_TEMPLATE)


def write_checkpoint(path: Path) -> Path:
    """Write the directory (created if missing; files already there are replaced) and return it. No weights."""
    path.mkdir(parents=True, exist_ok=True)
    processor = build_processor()
    processor.save_pretrained(path)
    processor.image_processor.save_pretrained(path)
    processor.video_processor.save_pretrained(path)
    config = build_config(PRESET, processor.tokenizer)
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    config.save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="the directory to write")
    print(write_checkpoint(parser.parse_args().path))


if __name__ == "__main__":
    main()
