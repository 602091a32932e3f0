"""The server's own chat template (the orchestrator's ``chat_template`` parameter, which the launcher's
``--chat-template`` sets; orchestrator/served_template.py) through a real tritonserver: the template itself, line
breaks and quotes included, goes through config.pbtxt, and every chat's prompt, its image's visual tokens placed by
the template's parts, is the one it writes."""
from __future__ import annotations

import json

import numpy as np
import pytest

from backends.runtime.tokenizer import load_tokenizer
from tests.e2e.conftest import repository_with, serve
from tests.e2e.test_ops import png
from tests.e2e.test_tokenize import tokenize_only
from client.pieces import piece_from_grpc

pytestmark = pytest.mark.e2e
DEFAULT, BRIEF = "You are a helpful assistant.", "You answer briefly."
TEMPLATE = load_tokenizer(None).chat_template.replace(DEFAULT, BRIEF) + '{{- "" }}'  # a quote to carry
MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in it?"}]}]


@pytest.fixture(scope="module")
def custom(media_dir, tmp_path_factory):
    repository = repository_with(tmp_path_factory.mktemp("template") / "repository",
                                 {"orchestrator": {"chat_template": TEMPLATE}})
    with serve(media_dir, repository) as srv:
        yield srv


def _prompt(grpc_url: str) -> tuple[int, ...]:
    result, error = tokenize_only(grpc_url, messages=np.array([json.dumps(MESSAGES).encode()], dtype=np.object_),
                                  image=np.array([png(np.full((56, 84, 3), 90, np.uint8))], dtype=np.object_))
    assert error is None, error
    return piece_from_grpc(result).input_ids


def test_every_chat_is_written_by_the_servers_template(custom, server):
    assert "\n" in TEMPLATE and '"' in TEMPLATE and BRIEF in TEMPLATE
    tokenizer = load_tokenizer(None)
    mine, default = _prompt(f"127.0.0.1:{custom.ports.grpc}"), _prompt(f"127.0.0.1:{server.ports.grpc}")
    assert DEFAULT in tokenizer.decode(default)  # the checkpoint's template, with the image's tokens
    assert tokenizer.decode(mine) == tokenizer.decode(default).replace(DEFAULT, BRIEF)
