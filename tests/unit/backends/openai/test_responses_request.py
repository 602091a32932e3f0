"""The Responses API's request (backends/openai/responses_api/request.py): the chat request it runs as (messages,
parts, sampling, the template's options, structured outputs, log probabilities), what vLLM 0.26 refuses or this
server cannot serve (a 400 naming the field), and the chat's error names said as the request sent them; and the
route's body errors, API key and body limit through the app (no tritonserver needed for those)."""
from __future__ import annotations

import json
import socket

import pytest
from fastapi.testclient import TestClient

from backends.openai.app import create_app
from backends.openai.config import ApiConfig
from backends.openai.convert import chat_request
from backends.openai.errors import ApiError
from backends.openai.responses_api.request import ResponsesRequest

IMAGE = "data:image/png;base64,iVBORw0KGgo="


def _body(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "tiny", "input": "Hi", **fields})


def _orchestrator(**fields):
    body = _body(**fields)
    assert body.refusal() is None
    chat = body.chat_request()
    assert chat.refusal() is None
    return chat_request(chat)


def test_a_string_input_is_a_user_message_after_the_instructions():
    sent = _orchestrator(instructions="Be brief.", max_output_tokens=7, temperature=0, top_p=0.9, seed=3,
                         ignore_eos=True, stream=True)
    assert json.loads(sent.messages) == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert sent.sampling == {"max_tokens": 7, "temperature": 0.0, "top_p": 0.9, "seed": 3, "ignore_eos": True}
    assert sent.stream and sent.chat_template_kwargs is None and not sent.return_logprobs


def test_without_max_output_tokens_the_reply_runs_to_the_servers_limit():
    """vLLM's default: up to the context's end (here at most the orchestrator's default_max_tokens)."""
    assert _orchestrator().sampling == {"max_tokens": None}


def test_message_items_and_their_parts_become_the_chats():
    sent = _orchestrator(instructions="", input=[
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "What is it?"}, {"type": "input_image", "image_url": IMAGE, "detail": "low"},
            {"type": "input_image", "image_url": "file:///data/b.png"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Un chat.", "annotations": []}]},
        {"role": "user", "content": "And now?"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}])
    assert json.loads(sent.messages) == [  # empty instructions add no message (vLLM's rule)
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": [{"type": "text", "text": "What is it?"}, {"type": "image"}, {"type": "image"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Un chat."}]},
        {"role": "user", "content": "And now?"},
        {"role": "assistant", "content": [{"type": "text", "text": "I can't."}]}]  # a refusal: the assistant's text
    assert [(m.kind, m.url) for m in sent.media] == [("image", IMAGE), ("image", "file:///data/b.png")]


def test_a_last_item_in_progress_is_continued():
    """vLLM's should_continue_final_message: the model goes on with the last item's text."""
    sent = _orchestrator(input=[{"role": "user", "content": "Count"},
                                {"role": "assistant", "content": "1, 2,", "status": "incomplete"}])
    assert json.loads(sent.chat_template_kwargs) == {"add_generation_prompt": False, "continue_final_message": True}


def test_reasoning_effort_goes_to_the_template_as_vllm_merges_it():
    answered = {"add_generation_prompt": True, "continue_final_message": False}
    sent = _orchestrator(reasoning={"effort": "low"}, chat_template_kwargs={"reasoning_effort": "high", "x": 1})
    assert json.loads(sent.chat_template_kwargs) == {"enable_thinking": True, "reasoning_effort": "low", "x": 1,
                                                     **answered}
    sent = _orchestrator(reasoning={"effort": "none"}, chat_template_kwargs={"enable_thinking": True})
    assert json.loads(sent.chat_template_kwargs) == {"enable_thinking": True, "reasoning_effort": "none", **answered}


@pytest.mark.parametrize("text_format, held", [
    ({"type": "text"}, None),
    ({"type": "json_object"}, {"json_object": True}),
    ({"type": "json_schema", "name": "r", "strict": True, "schema": {"type": "object"}}, {"json": {"type": "object"}}),
])
def test_text_format_is_held_as_a_chats_response_format(text_format, held):
    assert _orchestrator(text={"format": text_format, "verbosity": "low"}).sampling.get("structured_outputs") == held


def test_include_logprobs_asks_for_the_top_tokens():
    sent = _orchestrator(include=["message.output_text.logprobs", "reasoning.encrypted_content"], top_logprobs=3)
    assert sent.return_logprobs and sent.sampling["logprobs"] == 3
    assert not _orchestrator(top_logprobs=3).return_logprobs  # without include: ignored, as by vLLM


@pytest.mark.parametrize("fields, param, words", [
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools", "tool-call parser"),
    ({"background": True}, "background", "VLLM_ENABLE_RESPONSES_API_STORE"),
    ({"truncation": "auto"}, "truncation", "never truncated"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt templates are not supported"),
    ({"priority": 2}, "priority", "priority scheduling is not enabled"),
    ({"media_io_kwargs": {"video": {"num_frames": 4}}}, "media_io_kwargs", "mm_processor_kwargs"),
    ({"enable_response_messages": True}, "enable_response_messages", "not supported"),
    ({"previous_input_messages": [{"role": "user"}]}, "previous_input_messages", "harmony"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "name": "f"}}, "tool_choice", "needs tools"),
    ({"text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a+"}}, "structured_outputs",
     "not both"),
    ({"text": {"format": {"type": "json_schema", "name": "r"}}}, "text", "text.format.schema: Field required"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text", "text.format.name: Field required"),
    ({"top_logprobs": -1}, "top_logprobs", "must be in [0, 20], got -1"),  # also without include (OpenAI's range)
    ({"top_logprobs": 21, "include": ["message.output_text.logprobs"]}, "top_logprobs", "must be in [0, 20]"),
    ({"tool_choice": "bogus"}, "tool_choice", "tool_choice: must be \"none\", \"auto\", \"required\" or an object"),
    ({"tool_choice": {"name": "f"}}, "tool_choice", "got {'name': 'f'}"),
    ({"conversation": "conv_1"}, "conversation", "stores no conversations"),
    ({"conversation": {"id": "conv_1"}}, "conversation", "send the conversation's items in input"),
    ({"input": []}, "input", "no message to answer"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]}, "input",
     "input[0].content[0].image_url: files are not served"),
])
def test_what_vllm_refuses_or_this_server_cannot_serve_is_named(fields, param, words):
    refused = _body(**fields).refusal()
    assert refused is not None and refused[0] == param and words in refused[1], refused


def test_what_changes_nothing_here_is_taken():
    body = _body(store=True, metadata={"k": "v"}, user="u1", service_tier="flex", prompt_cache_key="c",
                 parallel_tool_calls=False, max_tool_calls=3, tool_choice="none", truncation="disabled", tools=[],
                 include=["message.input_image.image_url"], text={"verbosity": "high"}, cache_salt="s")
    assert body.refusal() is None and body.chat_request().refusal() is None


def test_null_is_unset_and_vllms_unchecked_limits_are_taken():
    """``tools`` and ``conversation`` null as left out; OpenAI's limits that vLLM 0.26 does not check (metadata's 16
    keys of 64 and values of 512 characters, a json_schema name's pattern) are not checked either."""
    body = _body(tools=None, conversation=None, tool_choice=None, top_logprobs=None,
                 metadata={f"{'k' * 70}{i}": "v" * 600 for i in range(17)},
                 text={"format": {"type": "json_schema", "name": "not a valid name!" * 5, "schema": {}}})
    assert body.refusal() is None and body.chat_request().refusal() is None


@pytest.mark.parametrize("fields, message, param, said, named", [
    ({"instructions": "Hi"}, "messages[0].content: holds <|image_pad|>", "messages",
     "instructions: holds <|image_pad|>", "input"),
    ({"instructions": "Hi"}, "messages[1].content: holds <|image_pad|>", "messages", "input: holds <|image_pad|>",
     "input"),
    ({"input": [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "input_image",
                                                                            "image_url": IMAGE}]}]},
     "messages[1].content[0].image_url: not a decodable image", "messages",
     "input[1].content[0].image_url: not a decodable image", "input"),
    ({}, "prompt too long: 40000 tokens", "messages", "prompt too long: 40000 tokens", "input"),
    ({"max_output_tokens": 0}, "max_tokens must be at least 1, got 0", "max_tokens",
     "max_output_tokens must be at least 1, got 0", "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "r", "schema": {"type": "x"}}}},
     'structured_outputs: Unsupported type "x"', "structured_outputs", 'text.format: Unsupported type "x"', "text"),
    ({"instructions": "Be brief." * 9000}, "prompt too long: its 40000 tokens (...)", "messages",
     "prompt too long: its 40000 tokens (...) (the prompt is the instructions and the input: shorten either)",
     "instructions, input"),
    ({"instructions": "Be brief." * 9000, "input": []}, "the prompt (40000 tokens, text and visual) needs", "messages",
     "the prompt (40000 tokens", "instructions"),
    ({"instructions": "Be brief."}, "prompt too long: its 40000 tokens (...) (at most 9 visual tokens fit: ...)",
     "messages", "prompt too long", "input"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs: bad regex", "structured_outputs",
     "structured_outputs: bad regex", "structured_outputs"),
    ({"input": [{"role": "assistant", "content": [], "status": "in_progress"}]},
     "chat_template_kwargs: continue_final_message needs a final message that ends with text",
     "continue_final_message", "input: a last item whose status is in_progress or incomplete (continued) needs",
     "input"),
])
def test_the_chats_errors_name_what_this_request_sent(fields, message, param, said, named):
    error = _body(**fields).named(ApiError(400, message, param=param))
    assert error.message.startswith(said) and error.param == named and error.status == 400, error.message


@pytest.fixture(scope="module")
def client():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with TestClient(create_app(ApiConfig(grpc_url=f"127.0.0.1:{port}", max_body_bytes=4096))) as c:
        yield c


@pytest.mark.parametrize("body, param, words", [
    ({"model": "m"}, "input", "input: Field required"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input",
     "input[0]: only message items are served (role and content), not 'function_call_output' items"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input",
     "input[0].content[0]: Input should be a part of type 'input_text'"),
    # a chat's own parts: vLLM validates the input as OpenAI's types, which have none of them
    ({"input": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "file:///a.mp4"}}]}]},
     "input", "input[0].content[0]: Input should be a part of type 'input_text', 'output_text', 'refusal' or "
              "'input_image'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": {"url": IMAGE}}]}]}, "input",
     "input[0].content[0].image_url: Input should be a valid string"),  # no union tag in the place
    ({"input": [{"role": "assistant", "content": [{"type": "refusal", "text": "x"}]}]}, "input",
     "input[0].content[0].refusal: Field required"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "r", "schema": "x"}}}, "text",
     "text.format.schema: Input should be a valid dictionary"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "input[0].role: Input should be 'user'"),
    ({"input": "x", "include": ["everything"]}, "include", "include[0]: Input should be"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text", "text.format.type: Input should be"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata", "metadata.k: Input should be a valid string"),
])
def test_a_body_that_fails_validation_is_400_naming_the_field(client, body, param, words):
    answer = client.post("/v1/responses", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["message"].startswith(words), error


def test_tools_null_is_taken_as_left_out(client):
    answer = client.post("/v1/responses", json={"input": "x", "tools": None, "conversation": None})
    assert answer.status_code == 503, answer.text  # past the body's validation, to the tritonserver not there


@pytest.mark.parametrize("method, path", [("GET", "/v1/responses/resp_1"), ("DELETE", "/v1/responses/resp_1"),
                                          ("POST", "/v1/responses/resp_1/cancel"),
                                          ("GET", "/v1/responses/resp_1/input_items")])
def test_the_routes_of_stored_responses_answer_not_found(client, method, path):
    """vLLM 0.26's answer without its store (its retrieve and cancel routes), in OpenAI's error shape."""
    answer = client.request(method, path)
    assert answer.status_code == 404, answer.text
    error = answer.json()["error"]
    assert error["message"].startswith("Response with id 'resp_1' not found: this server stores no responses")
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "response_id",
                                                              "response_not_found")


def test_the_body_limit_and_api_keys_guard_the_route(client):
    answer = client.post("/v1/responses", content=b"x" * 5000, headers={"content-type": "application/json"})
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "request_too_large"
    with TestClient(create_app(ApiConfig(grpc_url="127.0.0.1:1", api_keys=("k1",)))) as keyed:
        refused = keyed.post("/v1/responses", json={"input": "Hi"})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
