"""The server's own chat template (the orchestrator's ``chat_template`` parameter, which the launcher's
``--chat-template`` sets; orchestrator/served_template.py) through a real tritonserver: the template itself, line
breaks and quotes included, goes through config.pbtxt, and every chat's prompt, its image's visual tokens placed by
the template's parts, is the one it writes; a video, for which this template writes no placeholder, is refused."""
from __future__ import annotations

import json

import numpy as np
import pytest

from backends.runtime.tokenizer import load_tokenizer
from tests.e2e.conftest import repository_with, serve
from tests.e2e.test_ops import png
from tests.e2e.test_tokenize import tokenize_only
from tests.media import make_video
from client.pieces import piece_from_grpc

pytestmark = pytest.mark.e2e
DEFAULT, BRIEF = "You are a helpful assistant.", "You answer briefly."
ROLE = "<|im_start|>{{ message['role'] }}\n"  # the role line, to which the template below adds what vLLM hands it
TEMPLATE = load_tokenizer(None).chat_template.replace(DEFAULT, BRIEF).replace(ROLE, (
    "<|im_start|>{{ message['role'] }}{{ ' (' + message.name + ')' if message.name else '' }}\n"
    "{{ '<think>' + message.reasoning + '</think>' if message.reasoning else '' }}")).replace(
    "<|vision_start|><|video_pad|><|vision_end|>", "") + '{{- "" }}'  # a quote; images only: no video's placeholder
MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in it?"}]}]


@pytest.fixture(scope="module")
def custom(media_dir, tmp_path_factory):
    repository = repository_with(tmp_path_factory.mktemp("template") / "repository",
                                 {"orchestrator": {"chat_template": TEMPLATE}})
    with serve(media_dir, repository) as srv:
        yield srv


def _prompt(grpc_url: str, messages: list[dict] = MESSAGES) -> tuple[int, ...]:
    image = [png(np.full((56, 84, 3), 90, np.uint8))] if messages is MESSAGES else []
    result, error = tokenize_only(grpc_url, messages=np.array([json.dumps(messages).encode()], dtype=np.object_),
                                  **({"image": np.array(image, dtype=np.object_)} if image else {}))
    assert error is None, error
    return piece_from_grpc(result).input_ids


def test_every_chat_is_written_by_the_servers_template(custom, server):
    assert "\n" in TEMPLATE and '"' in TEMPLATE and BRIEF in TEMPLATE
    tokenizer = load_tokenizer(None)
    mine, default = _prompt(f"127.0.0.1:{custom.ports.grpc}"), _prompt(f"127.0.0.1:{server.ports.grpc}")
    assert DEFAULT in tokenizer.decode(default)  # the checkpoint's template, with the image's tokens
    assert tokenizer.decode(mine) == tokenizer.decode(default).replace(DEFAULT, BRIEF)


def test_a_messages_name_and_an_assistants_reasoning_reach_the_template(custom):
    """vLLM hands them to the template: ``name`` on any message, ``reasoning`` (or ``reasoning_content``) on an
    assistant's."""
    messages = [{"role": "user", "content": "Hi.", "name": "Bob"},
                {"role": "assistant", "content": "Hello.", "reasoning_content": "greet back"},
                {"role": "user", "content": "Bye."}]
    written = load_tokenizer(None).decode(_prompt(f"127.0.0.1:{custom.ports.grpc}", messages))
    assert "<|im_start|>user (Bob)\nHi." in written and "<|im_start|>assistant\n<think>greet back</think>Hello." \
        in written


def test_a_template_that_takes_each_content_as_a_string_serves_an_image_as_vllm_writes_it(media_dir, tmp_path):
    """A ChatML template written for text chats (vLLM's "string" content format, orchestrator/content_format.py):
    the image's placeholder on a line before the text, as vLLM hands it to such a template."""
    chatml = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
              "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    repository = repository_with(tmp_path / "repository", {"orchestrator": {"chat_template": chatml}})
    with serve(media_dir, repository) as srv:
        written = load_tokenizer(None).decode(_prompt(f"127.0.0.1:{srv.ports.grpc}"))
    pads = written.count("<|image_pad|>")
    assert pads > 0 and written == ("<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * pads
                                    + "<|vision_end|>\nWhat is in it?<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_for_images_only_is_served_and_refuses_a_video_naming_it(custom):
    """vLLM starts with such a template too; the video is the client's problem: an error naming the kind (the
    orchestrator's InvalidInput, INVALID_ARG / HTTP 400), and the server answers the next chat."""
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    result, error = tokenize_only(f"127.0.0.1:{custom.ports.grpc}",
                                  messages=np.array([json.dumps(messages).encode()], dtype=np.object_),
                                  video=np.array([make_video(None, 64, 48, 8, 10)], dtype=np.object_))
    assert result is None, result
    says = "messages: this server's chat template (the launcher's --chat-template) writes no placeholder for a video"
    assert error.message().startswith(says), error.message()
    assert _prompt(f"127.0.0.1:{custom.ports.grpc}")  # the image's chat still served
