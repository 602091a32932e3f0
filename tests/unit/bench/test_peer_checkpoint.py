"""The peer benchmark's weightless checkpoints (bench/peer/checkpoint.py, bench/peer/models.py): the families' special
-token ids, and transformers' processor (what vLLM runs) counting the same prompt tokens as UnifiedServe's own prompt
building, for Qwen2.5-VL-7B and InternVL3-38B (text, an image, a video)."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image
from transformers import AutoConfig, AutoProcessor
from transformers.video_utils import VideoMetadata

from backends.runtime.presets import preset_family
from backends.runtime.tokenizer import SPECIAL_TOKENS, load_tokenizer
from bench.peer.checkpoint import QWEN_MODEL_VOCAB, write_checkpoint
from bench.peer.models import INTERNVL_FRAMES, MODELS
from flashcodec.families import MediaOptions, family
from flashcodec.sampling import VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS
from orchestrator.inputs import MediaInput
from orchestrator.media import probe_media
from orchestrator.messages import user_turn
from orchestrator.prompt import Prompt, build_chat_prompt
from tests.media import all_frames, make_image, make_video

pytest.importorskip("torchvision")  # InternVL's processors need it
QUESTION = "Describe what you see in detail."
CHECKED = ("qwen2_5_vl_7b", "internvl3_38b")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """model -> (checkpoint directory, its processor as transformers loads it), each written once."""
    done = {}

    def get(model: str):
        if model not in done:
            path = write_checkpoint(tmp_path_factory.mktemp("peer") / MODELS[model].checkpoint_dir,
                                    MODELS[model].preset)
            done[model] = path, AutoProcessor.from_pretrained(path, local_files_only=True)
        return done[model]
    return get


def test_qwen_special_tokens_have_their_ids(written):
    checkpoint, _ = written("qwen2_5_vl_7b")
    tokenizer = load_tokenizer(str(checkpoint))  # what the orchestrator loads from --model
    assert tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS) == list(range(151643, 151657))
    assert len(tokenizer) == QWEN_MODEL_VOCAB + len(SPECIAL_TOKENS)
    assert tokenizer.decode(tokenizer.encode("the lighthouse")) == "the lighthouse"
    config = AutoConfig.from_pretrained(checkpoint, local_files_only=True)
    assert (config.architectures, config.text_config.vocab_size) == (["Qwen2_5_VLForConditionalGeneration"], 152064)
    assert (config.image_token_id, config.video_token_id, config.text_config.eos_token_id) == (151655, 151656, 151645)


def test_internvl_special_tokens_have_the_hf_checkpoints_ids(written):
    checkpoint, processor = written("internvl3_38b")
    tokenizer = load_tokenizer(str(checkpoint))
    assert tokenizer.convert_tokens_to_ids(["<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "</box>", "<video>"]) \
        == [151645, 151665, 151666, 151667, 151673, 151674]
    config = AutoConfig.from_pretrained(checkpoint, local_files_only=True)
    # "<video>" lies past the model's 151,674 rows, as in the -hf checkpoints: the processor expands it into frames
    assert (len(tokenizer), config.text_config.vocab_size) == (151675, 151674)
    assert (config.architectures, config.image_token_id, config.text_config.eos_token_id) == (
        ["InternVLForConditionalGeneration"], 151667, 151645)
    assert (config.text_config.num_hidden_layers, config.vision_config.num_hidden_layers) == (64, 45)
    # what vLLM's InternS1 processor reads: the named tokens, tiles 1..12 with a thumbnail, frames as given
    assert (processor.video_token, processor.image_token, processor.image_seq_length) == ("<video>", "<IMG_CONTEXT>",
                                                                                          256)
    images = processor.image_processor
    assert (images.crop_to_patches, images.min_patches, images.max_patches) == (True, 1, 12)
    assert not processor.video_processor.do_sample_frames


def test_the_qwen_video_processor_caps_frames_as_qwen_vl_utils(written):
    video = written("qwen2_5_vl_7b")[1].video_processor
    assert video.cap_pixels_per_frame and video.do_sample_frames and video.fps == 2.0
    assert (video.size.shortest_edge, video.size.longest_edge) == (VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS)


def unifiedserve_prompt(checkpoint, model: str, media: list[MediaInput]) -> Prompt:
    """The prompt as the orchestrator builds it: the family's plan per probed item (a video with the requests'
    ``video_kwargs``: InternVL3's frame count), then the chat template with the family's expansions."""
    rules = family(preset_family(MODELS[model].preset))
    video_options = MediaOptions(**MODELS[model].video_kwargs)
    plans = [rules.plan_video(probe_media(m), video_options) if m.kind == "video" else rules.plan_image(probe_media(m))
             for m in media]
    turns = (user_turn(QUESTION, [item.kind for item in media]),)
    grids = [(m.kind, p.grid_thw, getattr(p, "second_per_grid_t", 0.0)) for m, p in zip(media, plans)]
    return build_chat_prompt(load_tokenizer(str(checkpoint)), turns, grids, rules)


def transformers_prompt_tokens(processor, images=None, videos=None, **kwargs) -> int:
    """Prompt tokens as transformers' processor counts them (vLLM's HF processor path)."""
    content = ([{"type": "image"}] * len(images or []) + [{"type": "video"}] * len(videos or [])
               + [{"type": "text", "text": QUESTION}])
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    out = processor(text=[text], images=images, videos=videos, return_tensors="pt", **kwargs)
    return out["input_ids"].shape[1]


@pytest.mark.parametrize("model", CHECKED)
def test_text_prompt_tokens_match(written, model):
    checkpoint, processor = written(model)
    assert transformers_prompt_tokens(processor) == len(unifiedserve_prompt(checkpoint, model, []).input_ids)


@pytest.mark.parametrize("model", CHECKED)
def test_a_1280x720_image_prompt_tokens_match(written, model):
    checkpoint, processor = written(model)
    data = make_image(1280, 720, "RGB", "JPEG")  # the scenarios' images
    image = np.array(Image.open(io.BytesIO(data)).convert("RGB"))
    ours = unifiedserve_prompt(checkpoint, model, [MediaInput("image", data=data)])
    assert transformers_prompt_tokens(processor, images=[image]) == len(ours.input_ids)
    if model.startswith("internvl3"):
        # vLLM's InternS1ProcessingInfo.get_num_image_tokens: the image processor's tile count x image_seq_length;
        # 1280x720 is 4x2 tiles and the thumbnail
        tiles = processor.image_processor.get_number_of_image_patches(720, 1280, {})
        assert tiles == 9 and ours.num_visual_tokens == tiles * processor.image_seq_length


def test_qwen_video_prompt_tokens_match(written):
    checkpoint, processor = written("qwen2_5_vl_7b")
    data = make_video(width=160, height=90, num_frames=75, fps=25)  # 3 s: 6 frames sampled at 2 fps
    frames = np.stack(all_frames(data))
    metadata = [VideoMetadata(total_num_frames=len(frames), fps=25.0, width=160, height=90, duration=3.0)]
    ours = unifiedserve_prompt(checkpoint, "qwen2_5_vl_7b", [MediaInput("video", data=data)])
    assert transformers_prompt_tokens(processor, videos=[frames], video_metadata=metadata) == len(ours.input_ids)


def test_internvl_video_prompt_tokens_match_vllms_frames(written):
    checkpoint, processor = written("internvl3_38b")
    data = make_video(width=160, height=90, num_frames=75, fps=25)
    frames = np.stack(all_frames(data))
    # vLLM 0.26's OpenCV loader (vllm/multimodal/video.py, VideoBackend.compute_frames_index_to_sample) with
    # --media-io-kwargs' num_frames: evenly spaced frames, handed to the processor without metadata
    sampled = frames[np.linspace(0, len(frames) - 1, min(INTERNVL_FRAMES, len(frames)), dtype=int)]
    ours = unifiedserve_prompt(checkpoint, "internvl3_38b", [MediaInput("video", data=data)])
    # the request's mm_processor_kwargs reach the processor, which keeps the frames it is given
    theirs = transformers_prompt_tokens(processor, videos=[sampled], **MODELS["internvl3_38b"].video_kwargs)
    assert theirs == len(ours.input_ids)
    assert ours.num_visual_tokens == INTERNVL_FRAMES * 256 and ours.media[0].num_groups == INTERNVL_FRAMES
