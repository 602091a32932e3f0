"""The peer benchmark's weightless checkpoint (bench/peer/checkpoint.py): Qwen's special-token ids, and transformers'
Qwen2.5-VL processor (what vLLM runs) counting the same prompt tokens as UnifiedServe's own prompt building."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image
from transformers import AutoConfig, AutoProcessor
from transformers.video_utils import VideoMetadata

from backends.runtime.tokenizer import SPECIAL_TOKENS, load_tokenizer
from bench.peer.checkpoint import QWEN_MODEL_VOCAB, write_checkpoint
from flashcodec.sampling import VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS
from orchestrator.inputs import MediaInput
from orchestrator.media import plan_media
from orchestrator.messages import user_turn
from orchestrator.prompt import QWEN, build_chat_prompt
from orchestrator.sampling_params import RequestParams
from tests.media import all_frames, make_image, make_video

QUESTION = "Describe what you see in detail."


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("peer") / "qwen2_5_vl_7b_dummy")


@pytest.fixture(scope="module")
def processor(checkpoint):
    return AutoProcessor.from_pretrained(checkpoint, local_files_only=True)


def test_special_tokens_have_qwens_ids(checkpoint):
    tokenizer = load_tokenizer(str(checkpoint))  # what the orchestrator loads from --model
    assert tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS) == list(range(151643, 151657))
    assert len(tokenizer) == QWEN_MODEL_VOCAB + len(SPECIAL_TOKENS)
    assert tokenizer.decode(tokenizer.encode("the lighthouse")) == "the lighthouse"
    config = AutoConfig.from_pretrained(checkpoint, local_files_only=True)
    assert (config.architectures, config.text_config.vocab_size) == (["Qwen2_5_VLForConditionalGeneration"], 152064)
    assert (config.image_token_id, config.video_token_id, config.text_config.eos_token_id) == (151655, 151656, 151645)


def test_the_video_processor_caps_frames_as_qwen_vl_utils(processor):
    video = processor.video_processor
    assert video.cap_pixels_per_frame and video.do_sample_frames and video.fps == 2.0
    assert (video.size.shortest_edge, video.size.longest_edge) == (VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS)


def unifiedserve_prompt_tokens(checkpoint, media: list[MediaInput]) -> int:
    """Prompt tokens as the orchestrator counts them: plan_media per item, then the chat template."""
    plans = [plan_media(item, RequestParams(), QWEN) for item in media]
    turns = (user_turn(QUESTION, [item.kind for item in media]),)
    grids = [(m.kind, p.grid_thw, getattr(p, "second_per_grid_t", 0.0)) for m, p in zip(media, plans)]
    prompt = build_chat_prompt(load_tokenizer(str(checkpoint)), turns, grids)
    return len(prompt.input_ids)


def transformers_prompt_tokens(processor, images=None, videos=None, metadata=None) -> int:
    """Prompt tokens as transformers' processor counts them (vLLM's HF processor path)."""
    content = ([{"type": "image"}] * len(images or []) + [{"type": "video"}] * len(videos or [])
               + [{"type": "text", "text": QUESTION}])
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    out = processor(text=[text], images=images, videos=videos, video_metadata=metadata, return_tensors="pt")
    return out["input_ids"].shape[1]


def test_text_prompt_tokens_match(checkpoint, processor):
    assert transformers_prompt_tokens(processor) == unifiedserve_prompt_tokens(checkpoint, [])


def test_image_prompt_tokens_match(checkpoint, processor):
    data = make_image(320, 180, "RGB", "JPEG")
    image = np.array(Image.open(io.BytesIO(data)).convert("RGB"))
    ours = unifiedserve_prompt_tokens(checkpoint, [MediaInput("image", data=data)])
    assert transformers_prompt_tokens(processor, images=[image]) == ours


def test_video_prompt_tokens_match(checkpoint, processor):
    data = make_video(width=160, height=90, num_frames=75, fps=25)  # 3 s: 6 frames sampled at 2 fps
    frames = np.stack(all_frames(data))
    metadata = [VideoMetadata(total_num_frames=len(frames), fps=25.0, width=160, height=90, duration=3.0)]
    ours = unifiedserve_prompt_tokens(checkpoint, [MediaInput("video", data=data)])
    assert transformers_prompt_tokens(processor, videos=[frames], metadata=metadata) == ours
