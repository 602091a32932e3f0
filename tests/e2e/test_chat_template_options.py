"""How the chat template is applied, through tritonserver (orchestrator/chat_options.py): vLLM's
``continue_final_message`` (a prefilled answer the model continues), ``add_generation_prompt`` and the template's own
variables (``chat_template_kwargs``), over the OpenAI API and the orchestrator's ``chat_template_kwargs`` input. A
chat's greedy reply equals the completion of its prompt written out by transformers' ``apply_chat_template`` with the
same options; bad values are refused naming the field."""
from __future__ import annotations

import json

import numpy as np
import openai
import pytest

from backends.runtime.tokenizer import load_tokenizer
from client.api import ServerError
from tests.e2e.conftest import openai_sdk
from tests.e2e.test_vllm_parity import kserve_request

N = 8
GREEDY = {"max_tokens": N, "temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
MESSAGES = [{"role": "user", "content": "Describe the sea."}, {"role": "assistant", "content": "The sea is"}]


@pytest.fixture(scope="module")
def sdk(server, tmp_path_factory):
    with openai_sdk(server, tmp_path_factory.mktemp("openai")) as client:
        yield client


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": None}, {"role": "user", "content": "And?"}],
], ids=["empty", "null"])
def test_empty_and_null_contents_are_rendered_as_vllm_renders_them(sdk, messages):
    """An empty message, or an assistant's null content (OpenAI's), is a message without text: the template still
    writes its role."""
    written = load_tokenizer(None).apply_chat_template(
        [{**m, "content": m["content"] or ""} for m in messages], tokenize=False, add_generation_prompt=True)
    chat = sdk.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    completion = sdk.completions.create(model="tiny", prompt=written, **GREEDY)
    assert chat.choices[0].token_ids == completion.choices[0].token_ids


@pytest.mark.parametrize("fields", [
    {"add_generation_prompt": False, "continue_final_message": True},
    {"add_generation_prompt": False},
    {"chat_template_kwargs": {"add_vision_id": True, "enable_thinking": False}},  # one it reads, one it ignores
])
def test_a_chat_is_completed_as_the_prompt_transformers_writes_with_the_same_options(sdk, fields):
    options = {"add_generation_prompt": fields.get("add_generation_prompt", True),
               "continue_final_message": fields.get("continue_final_message", False),
               **fields.get("chat_template_kwargs", {})}
    written = load_tokenizer(None).apply_chat_template(MESSAGES, tokenize=False, **options)
    chat = sdk.chat.completions.create(model="tiny", messages=MESSAGES, **{
        **GREEDY, "extra_body": {**GREEDY["extra_body"], **fields}})
    completion = sdk.completions.create(model="tiny", prompt=written, **GREEDY)
    assert chat.choices[0].token_ids == completion.choices[0].token_ids and len(completion.choices[0].token_ids) == N
    assert chat.usage.prompt_tokens == completion.usage.prompt_tokens


def test_both_flags_true_is_refused_naming_them(sdk, grpc_url):
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=N,
                                    extra_body={"continue_final_message": True})
    assert "add_generation_prompt and continue_final_message cannot both be true" in refused.value.message
    tensors = [("messages", np.array([json.dumps(MESSAGES).encode()], dtype=np.object_), "BYTES"),
               ("chat_template_kwargs", np.array([b'{"add_generation_prompt": 1}'], dtype=np.object_), "BYTES")]
    with pytest.raises(ServerError, match="chat_template_kwargs: add_generation_prompt must be true or false, got 1"):
        kserve_request(grpc_url, tensors)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_echo_starts_the_reply_with_the_prefilled_answer(sdk, stream):
    """vLLM's chat ``echo`` beside ``continue_final_message``: the answer the model continues, then its tokens."""
    fields = {**GREEDY["extra_body"], "add_generation_prompt": False, "continue_final_message": True}
    plain = sdk.chat.completions.create(model="tiny", messages=MESSAGES, **{**GREEDY, "extra_body": fields})
    reply = sdk.chat.completions.create(model="tiny", messages=MESSAGES, stream=stream,
                                        **{**GREEDY, "extra_body": {**fields, "echo": True}})
    text = "".join(c.choices[0].delta.content or "" for c in reply if c.choices) if stream \
        else reply.choices[0].message.content
    assert text == "The sea is" + plain.choices[0].message.content
