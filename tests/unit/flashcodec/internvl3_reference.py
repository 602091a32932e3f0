"""transformers 5.17's InternVL processor, set up as an InternVL3 `-hf` checkpoint's (the reference of
`flashcodec.families.internvl3`): 448 px tiles, ImageNet mean/std, 1..12 tiles (`convert_internvl_weights_to_hf.py`'s
`write_image_processor`), and a tokenizer with InternVL's image tokens and chat template over the offline one."""
from __future__ import annotations

import functools

from transformers import GotOcr2ImageProcessor, InternVLProcessor, InternVLVideoProcessor, PreTrainedTokenizerFast
from transformers.utils.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from backends.runtime.tokenizer import build_offline_tokenizer
from flashcodec.families.internvl3 import CONTEXT, END_IMAGE, START_IMAGE, VIDEO

SETTINGS = dict(size={"height": 448, "width": 448}, image_mean=IMAGENET_DEFAULT_MEAN, image_std=IMAGENET_DEFAULT_STD)
# convert_internvl_weights_to_hf.py's chat_template
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}{% elif content['type'] == 'video' %}{{ '<video>\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}{{'<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
)


@functools.cache
def image_processor() -> GotOcr2ImageProcessor:
    return GotOcr2ImageProcessor(**SETTINGS, crop_to_patches=True)


@functools.cache
def video_processor() -> InternVLVideoProcessor:
    return InternVLVideoProcessor(**SETTINGS)


def tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import AddedToken

    backend = build_offline_tokenizer().backend_tokenizer
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in (START_IMAGE, END_IMAGE, CONTEXT, VIDEO)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE,
        extra_special_tokens={"start_image_token": START_IMAGE, "end_image_token": END_IMAGE,
                              "context_image_token": CONTEXT, "video_token": VIDEO})


@functools.cache
def processor() -> InternVLProcessor:
    return InternVLProcessor(image_processor=image_processor(), tokenizer=tokenizer(),
                             video_processor=video_processor(), image_seq_length=256)
