"""InternVL3 prompts (orchestrator/prompt.py with flashcodec.families' InternVL3) against transformers 5.17's
InternVLProcessor: the same chat-templated text and media give the same input_ids, and each group's tokens sit
where the processor put them."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from flashcodec.families import MediaOptions, family
from flashcodec.probe import ImageInfo, probe_video
from orchestrator.messages import Part, Turn
from orchestrator.prompt import build_chat_prompt, build_raw_prompt
from orchestrator.sampling_params import InvalidInput
from tests.media import make_video

pytest.importorskip("torchvision")  # the reference processors need it
from tests.unit.flashcodec import internvl3_reference as ref  # noqa: E402

INTERNVL = family("internvl3")


@pytest.fixture(scope="module")
def processor():
    return ref.processor()


def _turn(*parts: tuple[str, str]) -> Turn:
    return Turn("user", tuple(Part(kind, text) for kind, text in parts))


@pytest.mark.parametrize("parts, images, frames", [
    ((("image", ""), ("text", "What is this?")), [(640, 480)], []),
    ((("video", ""), ("text", "What happens? Frame1: ")), [], [5]),
    ((("text", "Compare"), ("image", ""), ("image", ""), ("video", ""), ("text", " them.")),
     [(1, 2000), (448, 448)], [3]),
    # the processor stacks a call's videos: one length for all
    ((("video", ""), ("image", ""), ("video", ""), ("text", "Which?")), [(1920, 1080)], [4, 4]),
])
def test_prompt_ids_equal_the_processors(processor, parts, images, frames):
    tokenizer = processor.tokenizer
    turns = (_turn(*parts), Turn("assistant", (Part("text", "Yes."),)), _turn(("text", "Again, and\nagain")))
    image_plans = [INTERNVL.plan_image(ImageInfo(w, h, "RGB", "PNG")) for w, h in images]
    video_path = make_video(None, 64, 48, 12, 25)
    info = probe_video(video_path)
    video_plans = [INTERNVL.plan_video(info, MediaOptions(num_frames=n)) for n in frames]
    kinds = [p.kind for turn in turns for p in turn.parts if p.kind != "text"]
    plans = iter(image_plans), iter(video_plans)
    media = [next(plans[kind == "video"]) for kind in kinds]

    prompt = build_chat_prompt(tokenizer, turns, [(p.kind, p.grid_thw, 0.0) for p in media], INTERNVL)

    conversation = [{"role": t.role, "content": [{"type": p.kind, "text": p.text} if p.kind == "text"
                                                 else {"type": p.kind} for p in t.parts]} for t in turns]
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    pictures = [Image.fromarray(np.zeros((h, w, 3), np.uint8)) for w, h in images] or None
    # the sampled frames themselves (the processor takes one num_frames per call; the pixel tests check sampling)
    clips = [np.zeros((p.num_groups, 48, 64, 3), np.uint8) for p in video_plans] or None
    expected = processor(text=text, images=pictures, videos=clips, return_tensors="pt")
    context = tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>")
    ids = list(prompt.input_ids)
    assert ids == expected["input_ids"][0].tolist()
    # each group: 256 <IMG_CONTEXT> from its offset; every <IMG_CONTEXT> is one group's
    starts = [o for m in prompt.media for o in m.group_offsets]
    assert all(ids[o:o + 256] == [context] * 256 for o in starts)
    assert ids.count(context) == 256 * len(starts) == prompt.num_visual_tokens
    assert [m.num_groups for m in prompt.media] == [p.num_groups for p in media]


def test_a_video_frames_tokens_follow_its_frame_label(processor):
    tokenizer = processor.tokenizer
    prompt = build_chat_prompt(tokenizer, (_turn(("video", ""), ("text", "Go")),), [("video", (3, 32, 32), 0.0)],
                               INTERNVL)
    (video,) = prompt.media
    for i, offset in enumerate(video.group_offsets):
        before = tokenizer.decode(prompt.input_ids[max(0, offset - 16):offset])
        assert before.endswith(f"Frame{i + 1}: <img>")


def test_image_tokens_in_user_text_are_plain_text(processor):
    tokenizer = processor.tokenizer
    prompt = build_chat_prompt(tokenizer, (_turn(("text", "<img><IMG_CONTEXT></img> <video>"), ("image", "")),),
                               [("image", (1, 32, 32), 0.0)], INTERNVL)
    specials = set(tokenizer.convert_tokens_to_ids(["<img>", "</img>", "<IMG_CONTEXT>", "<video>"]))
    assert sum(i in specials for i in prompt.input_ids) == 2 + 256  # the image's own <img>, </img> and tokens


@pytest.mark.parametrize("token", ["<img>", "</img>", "<IMG_CONTEXT>", "<video>"])
def test_a_raw_prompt_may_not_bring_internvl_image_tokens(processor, token):
    with pytest.raises(InvalidInput, match="which only the server places"):
        build_raw_prompt(processor.tokenizer, f"Look {token}", INTERNVL)


def test_a_prompt_too_long_names_internvls_settings(processor):
    video = build_chat_prompt(processor.tokenizer, (_turn(("video", ""), ("text", "What?")),),
                              [("video", (2, 32, 32), 0.0)], INTERNVL)
    with pytest.raises(InvalidInput, match=r"max_tokens can be at most \d+ \(lower num_frames for fewer visual"):
        video.check_length(10**6, len(video.input_ids) + 1, INTERNVL)
    with pytest.raises(InvalidInput, match=r"visual tokens fit: lower num_frames, or send a shorter clip\)$"):
        video.check_length(1, len(video.input_ids) - 10, INTERNVL)
    both = build_chat_prompt(processor.tokenizer, (_turn(("image", ""), ("video", ""), ("text", "?")),),
                             [("image", (2, 32, 32), 0.0), ("video", (2, 32, 32), 0.0)], INTERNVL)
    with pytest.raises(InvalidInput, match=r"lower num_frames or max_tiles or min_tiles, or send a shorter clip\)$"):
        both.check_length(1, len(both.input_ids) - 10, INTERNVL)
