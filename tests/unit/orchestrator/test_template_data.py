"""Tools and tool calls handed to the chat template (orchestrator/template_data.py, orchestrator/prompt.py), as vLLM
hands them: the prompt equals transformers' ``apply_chat_template`` of vLLM's conversation (``tools=`` the tool
definitions, an assistant's ``tool_calls`` with their arguments parsed to objects, a tool message's
``tool_call_id``), under a template that writes them; bad ones are refused naming where they are."""
from __future__ import annotations

import json

import pytest

from backends.runtime.tokenizer import build_offline_tokenizer
from orchestrator.chat_options import parse_chat_options
from orchestrator.messages import parse_messages
from orchestrator.prompt import QWEN, build_chat_prompt
from orchestrator.sampling_params import InvalidInput

# A tool-aware template in the manner of Qwen2.5's (text) one: tools in the system turn, calls and answers as JSON.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.content is string %}{{ message.content }}{% else %}"
    "{% for part in message.content %}{% if part.type == 'text' %}{{ part.text }}"
    "{% elif part.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}{% endif %}"
    "{% for call in message.tool_calls or [] %}\n<tool_call>{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}</tool_call>{% endfor %}"
    "{% if message.tool_call_id %} [{{ message.tool_call_id }}]{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [{"type": "function", "function": {
    "name": "weather", "description": "Today's weather.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
               {"id": "call_2", "type": "function", "function": {"name": "weather", "arguments": ""}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_offline_tokenizer(chat_template=TOOLS_TEMPLATE)


def _prompt(tokenizer, messages, kwargs: dict | None = None) -> str:
    turns = parse_messages(json.dumps(messages).encode(), 1 << 20)
    options = parse_chat_options([json.dumps(kwargs).encode()] if kwargs is not None else [])
    return tokenizer.decode(build_chat_prompt(tokenizer, turns, [], options=options).input_ids)


def test_tools_and_tool_calls_reach_the_template_as_vllm_hands_them(tokenizer):
    """vLLM's conversation: arguments parsed (an empty string is ``{}``), the tool's ``tool_call_id`` kept."""
    conversation = [HISTORY[0], {**HISTORY[1], "content": [], "tool_calls": [
        {**HISTORY[1]["tool_calls"][0], "function": {"name": "weather", "arguments": {"city": "Paris"}}},
        {**HISTORY[1]["tool_calls"][1], "function": {"name": "weather", "arguments": {}}}]}, HISTORY[2]]
    reference = tokenizer.apply_chat_template(conversation, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    prompt = _prompt(tokenizer, HISTORY, {"tools": TOOLS})
    assert prompt == reference
    assert '{"name": "weather", "arguments": {"city": "Paris"}}' in prompt and "[call_1]" in prompt
    assert '"description": "Today\'s weather."' in prompt


def test_tool_data_skips_the_prompt_cache_and_a_plain_conversation_is_unchanged(tokenizer):
    plain = [{"role": "user", "content": "Hi"}]
    assert _prompt(tokenizer, plain) == tokenizer.apply_chat_template(plain, tokenize=False,
                                                                      add_generation_prompt=True)
    first = _prompt(tokenizer, plain, {"tools": TOOLS})
    other = _prompt(tokenizer, plain, {"tools": [{**TOOLS[0], "function": {"name": "time"}}]})
    assert '"weather"' in first and '"time"' in other and "weather" not in other


def test_qwen2_5_vls_own_template_writes_no_tools_as_on_vllm():
    tokenizer = build_offline_tokenizer()
    assert _prompt(tokenizer, HISTORY, {"tools": TOOLS}) == _prompt(tokenizer, HISTORY)


@pytest.mark.parametrize("messages, words", [
    ([{"role": "assistant", "tool_calls": {"id": "x"}}], "messages[0].tool_calls: must be a list of tool calls"),
    ([{"role": "assistant", "tool_calls": [5]}], "messages[0].tool_calls[0]: must be {\"type\": \"function\""),
    ([{"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f"}}]}],
     "messages[0].tool_calls[0]: must be"),
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
     "messages[0].tool_calls[0].function.name: must be a string"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{nope"}}]}],
     "messages[0].tool_calls[0].function.arguments: not valid JSON"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}],
     "messages[0].tool_calls[0].function.arguments: must be a JSON string or an object, got 5"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f\u0000"}}]}],
     "messages[0].tool_calls: holds a NUL character"),
    ([{"role": "user", "content": "x", "name": json.loads("[" * 100 + "]" * 100)}],
     "messages[0].name: must be a string, got list"),  # was dropped without a word
    ([{"role": "tool", "content": "x", "tool_call_id": 7}], "messages[0].tool_call_id: must be a string, got int"),
])
def test_bad_tool_calls_are_refused_naming_them(messages, words):
    with pytest.raises(InvalidInput) as caught:
        parse_messages(json.dumps(messages).encode(), 1 << 20)
    assert str(caught.value).startswith(words), caught.value


def test_tool_calls_on_other_roles_are_ignored_as_vllm_ignores_them():
    (turn,) = parse_messages(json.dumps([{"role": "user", "content": "x", "tool_calls": "junk"}]).encode(), 1 << 20)
    assert turn.fields == ()


def test_names_and_an_assistants_reasoning_reach_the_template_as_vllm_hands_them():
    """vLLM's ``_parse_chat_message_content``: ``name`` on any role, an assistant's ``reasoning`` (or
    ``reasoning_content``) as both; ``reasoning`` on other roles ignored."""
    messages = [{"role": "user", "content": "x", "name": "Bob", "reasoning": "no"},
                {"role": "assistant", "content": "y", "reasoning_content": "mulling"}]
    user, assistant = parse_messages(json.dumps(messages).encode(), 1 << 20)
    assert user.fields == (("name", '"Bob"'),)
    assert assistant.fields == (("reasoning", '"mulling"'), ("reasoning_content", '"mulling"'))
    named = TOOLS_TEMPLATE.replace("<|im_start|>{{ message.role }}\n", "<|im_start|>{{ message.role }} "
                                   "{{ message.name }}{{ message.reasoning }}\n")
    prompt = _prompt(build_offline_tokenizer(chat_template=named), messages)
    assert "<|im_start|>user Bob\nx" in prompt and "<|im_start|>assistant mulling\ny" in prompt


@pytest.mark.parametrize("where", ["tools", "tool_calls"])
def test_a_media_token_in_tool_data_is_refused(tokenizer, where):
    """The template writes them as they are: a media token there would be taken for a placeholder."""
    assert "<|image_pad|>" in QWEN.reserved_tokens
    bad = [{**TOOLS[0], "function": {"name": "see <|image_pad|>"}}]
    messages = HISTORY if where == "tools" else [
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"x": "<|image_pad|>"}'}}]}]
    with pytest.raises(InvalidInput) as caught:
        _prompt(tokenizer, messages, {"tools": bad} if where == "tools" else None)
    named = "chat_template_kwargs: tools" if where == "tools" else "messages[0].tool_calls"
    assert str(caught.value) == f"{named}: holds <|image_pad|>, which only the server places"


def test_a_template_that_raises_refuses_the_request_naming_the_messages():
    tokenizer = build_offline_tokenizer(chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InvalidInput, match=r"^messages: the chat template refused the conversation \(roles must"):
        _prompt(tokenizer, [{"role": "user", "content": "Hi"}])
