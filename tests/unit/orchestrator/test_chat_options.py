"""The ``chat_template_kwargs`` input (orchestrator/chat_options.py) and the prompts it makes (orchestrator/prompt.py):
transformers' ``apply_chat_template`` with the same options is the reference; bad values are refused naming it."""
from __future__ import annotations

import json

import pytest

from backends.runtime.tokenizer import build_offline_tokenizer
from orchestrator.chat_options import ChatOptions, parse_chat_options
from orchestrator.inputs import InputLimits, RawRequest, parse_request
from orchestrator.messages import parse_messages
from orchestrator.prompt import build_chat_prompt
from orchestrator.sampling_params import InvalidInput

MESSAGES = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is "}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_offline_tokenizer()


def _options(text: str) -> ChatOptions:
    return parse_chat_options([text.encode()])


def _ids(tokenizer, messages, options: ChatOptions) -> list[int]:
    turns = parse_messages(json.dumps(messages).encode(), 1 << 20)
    return list(build_chat_prompt(tokenizer, turns, [], options=options).input_ids)


@pytest.mark.parametrize("text, expected", [
    ("{}", {"add_generation_prompt": True}),
    ('{"add_generation_prompt": false}', {"add_generation_prompt": False}),
    ('{"add_generation_prompt": false, "continue_final_message": true}',
     {"add_generation_prompt": False, "continue_final_message": True}),
    ('{"add_generation_prompt": false, "continue_final_message": true, "add_vision_id": true, "unread": 1}',
     {"add_generation_prompt": False, "continue_final_message": True, "add_vision_id": True}),
])
def test_prompts_equal_transformers_apply_chat_template_with_the_same_options(tokenizer, text, expected):
    reference = tokenizer.apply_chat_template(MESSAGES, tokenize=False, **expected)
    assert _ids(tokenizer, MESSAGES, _options(text)) == tokenizer.encode(reference, add_special_tokens=False)


def test_a_continued_final_message_ends_the_prompt_with_its_text_whole(tokenizer):
    ids = _ids(tokenizer, MESSAGES, _options('{"add_generation_prompt": false, "continue_final_message": true}'))
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\nMy favourite is ")  # its trailing space kept


def test_template_variables_it_reads_are_passed_and_others_dropped(tokenizer):
    options = _options('{"add_vision_id": true, "enable_thinking": false, "nested": {"a": [1, 2]}}')
    assert options.kwargs_for(tokenizer.chat_template) == {"add_vision_id": True}
    assert options.template_kwargs == (("add_vision_id", "true"), ("enable_thinking", "false"),
                                       ("nested", '{"a": [1, 2]}'))
    assert hash(options) == hash(_options('{"nested": {"a": [1, 2]}, "enable_thinking": false, "add_vision_id": true}'))


@pytest.mark.parametrize("values, words", [
    ([b"[]"], "must be a JSON object, got list"),
    ([b"{"], "not valid JSON"),
    ([b"\xff"], "not valid UTF-8"),
    ([b'{"a": ' + b"[" * 30000], "nested thousands deep"),  # json raises RecursionError, not ValueError
    ([b"{}", b"{}"], "expected one JSON object"),
    ([b'{"x": "' + b"a" * (1 << 20) + b'"}'], "expected one JSON object of at most 1048576 bytes"),
    ([b'{"add_generation_prompt": "no"}'], 'add_generation_prompt must be true or false, got "no"'),
    ([b'{"continue_final_message": 1}'], "continue_final_message must be true or false, got 1"),
    ([b'{"continue_final_message": true}'], "add_generation_prompt and continue_final_message cannot both be true"),
    ([b'{"tokenize": true}'], "tokenize is not a template setting"),
    ([b'{"messages": []}'], "messages is not a template setting"),
    ([b'{"tools": {"type": "function"}}'], "tools must be a list of tool objects"),
    ([b'{"tools": [1]}'], "tools must be a list of tool objects"),
    ([b'{"tools": [{"a": "\\u0000"}]}'], "tools: holds a NUL character"),
    ([b'{"tools": [{"a": "\\ud800"}]}'], "tools: not valid Unicode text"),
    ([b'{"tools": [' + b'{"a": ' * 70 + b"1" + b"}" * 70 + b"]}"], "tools: nested more than 64 deep"),
    ([b'{"tools": [{"a": "' + b"x" * (960 << 10) + b'"}]}'], "tools: 983051 bytes of JSON, over the limit of 983040"),
])
def test_bad_values_are_refused_naming_the_input(values, words):
    with pytest.raises(InvalidInput, match="^chat_template_kwargs: ") as caught:
        parse_chat_options(values)
    assert words in str(caught.value)


def test_requests_check_it_against_their_conversation():
    cont = b'{"add_generation_prompt": false, "continue_final_message": true}'
    messages = b'[{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image"}]}]'
    with pytest.raises(InvalidInput, match="continue_final_message needs a final message that ends with text"):
        parse_request(RawRequest([], messages=[messages], image_url=[b"data:image/png;base64,iVBORw0KGgo="],
                                 chat_template_kwargs=[cont]), InputLimits())
    with pytest.raises(InvalidInput, match="chat_template_kwargs: prompt is completed without the chat template"):
        parse_request(RawRequest([], prompt=[b"Hi"], chat_template_kwargs=[b"{}"]), InputLimits())
    parsed = parse_request(RawRequest([b"Hi"], chat_template_kwargs=[cont]), InputLimits())
    assert parsed.chat == ChatOptions(False, True)
