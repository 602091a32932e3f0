"""An OpenAI request -> the orchestrator's inputs (backends/openai/convert.py, schemas.py), read back by the
orchestrator's own validation (orchestrator/inputs.py) as the server would."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from pydantic import ValidationError
from tritonclient.utils import deserialize_bytes_tensor

from backends.openai.convert import MediaRef, chat_request, completion_requests
from backends.openai.errors import from_orchestrator
from backends.openai.schemas import ChatCompletionRequest, CompletionRequest
from orchestrator.inputs import InputLimits, RawRequest, parse_request
from orchestrator.messages import Part, Turn
from orchestrator.sampling_params import parse_sampling_parameters

PNG = "data:image/png;base64,iVBORw0KGgo="


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "tiny", **fields})


def _raw(request) -> RawRequest:
    """The RawRequest the orchestrator reads from the tensors of ``request.inputs()`` (their serialized bytes)."""
    tensors = {t.name(): t for t in request.inputs()}

    def strings(name: str) -> list[bytes]:
        if name not in tensors:
            return []
        assert tensors[name].datatype() == "BYTES"
        return list(deserialize_bytes_tensor(tensors[name]._get_content()))

    def flag(name: str) -> bool:
        return name in tensors and bool(np.frombuffer(tensors[name]._get_content(), dtype=bool)[0])

    return RawRequest(text_input=strings("text_input"), messages=strings("messages"), prompt=strings("prompt"),
                      image_url=strings("image_url"),
                      video_url=strings("video_url"), sampling_parameters=strings("sampling_parameters"),
                      stream=flag("stream"), exclude_input_in_output=flag("exclude_input_in_output"),
                      return_output_ids=flag("return_output_ids"), chat_template_kwargs=strings("chat_template_kwargs"),
                      return_input_ids=flag("return_input_ids"))


def test_a_chat_becomes_placeholders_and_urls_in_order(tmp_path):
    (tmp_path / "clip.mp4").write_bytes(b"video")
    request = chat_request(_chat(messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Compare"},
                                     {"type": "image_url", "image_url": {"url": PNG, "detail": "low"}},
                                     {"type": "video_url", "video_url": {"url": f"file://{tmp_path}/clip.mp4"}}]},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG}}]},
    ], stream=True))
    assert json.loads(request.messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "video"}]},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": [{"type": "image"}]},
    ]
    assert request.media == (MediaRef("image", PNG, "messages[1].content[1].image_url"),
                             MediaRef("video", f"file://{tmp_path}/clip.mp4", "messages[1].content[2].video_url"),
                             MediaRef("image", PNG, "messages[3].content[0].image_url"))
    parsed = parse_request(_raw(request), InputLimits(allowed_media_dirs=(tmp_path.resolve(),)))
    assert [m.kind for m in parsed.media] == ["image", "video", "image"]
    assert parsed.turns[1] == Turn("user", (Part("text", "Compare"), Part("image"), Part("video")))
    assert parsed.stream and parsed.exclude_input_in_output and not parsed.return_output_ids


def test_a_messages_name_and_an_assistants_reasoning_go_with_it():
    request = chat_request(_chat(messages=[
        {"role": "developer", "content": "Be brief.", "name": "ops"},
        {"role": "user", "content": "Hi", "name": "Bob", "reasoning": "not an assistant's"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "greet back"}]))
    assert json.loads(request.messages) == [
        {"role": "system", "content": "Be brief.", "name": "ops"}, {"role": "user", "content": "Hi", "name": "Bob"},
        {"role": "assistant", "content": "Hello.", "reasoning": "greet back"}]


def test_sampling_fields_take_vllm_names():
    request = chat_request(_chat(
        messages=[{"role": "user", "content": "hi"}], max_tokens=99, max_completion_tokens=7, temperature=0,
        top_p=0.5, top_k=3, min_p=0.1, seed=11, stop=["x", "y"], min_tokens=2, ignore_eos=True,
        return_token_ids=True, mm_processor_kwargs={"fps": 1.5, "max_pixels": 50176}, user="ignored",
        metadata={"a": "b"}))
    assert request.sampling == {"max_tokens": 7, "temperature": 0.0, "top_p": 0.5, "top_k": 3, "min_p": 0.1,
                                "seed": 11, "stop": ["x", "y"], "min_tokens": 2, "ignore_eos": True, "fps": 1.5,
                                "max_pixels": 50176}
    params = parse_sampling_parameters(json.dumps(request.sampling))  # the orchestrator takes every key
    assert (params.max_tokens, params.top_k, params.stop, params.max_pixels) == (7, 3, ("x", "y"), 50176)
    parsed = parse_request(_raw(request), InputLimits())
    assert parsed.return_output_ids and not parsed.stream
    assert parsed.extra_outputs.input_ids  # the reply's prompt_token_ids (vLLM's, with return_token_ids)


def test_a_chat_without_max_tokens_asks_for_the_rest_of_the_context_and_a_completion_for_16():
    """vLLM's defaults: its chat request's max_tokens is None (the rest of the context), its completion request's 16
    (the orchestrator's own default, so nothing is sent)."""
    chat = chat_request(_chat(messages=[{"role": "user", "content": "hi"}]))
    assert chat.sampling == {"max_tokens": None}
    assert parse_sampling_parameters(json.dumps(chat.sampling)).max_tokens is None
    [completion] = completion_requests(CompletionRequest(model="m", prompt="p"))
    assert "max_tokens" not in completion.sampling


def test_vllms_internvl_name_max_dynamic_patch_is_the_orchestrators_to_judge():
    """mm_processor_kwargs' max_dynamic_patch goes on as it is: the orchestrator reads it as max_tiles (its one
    alias rule, orchestrator.sampling_aliases.ALIASES), as it does from a KServe client or in media_defaults."""
    for kwargs in ({"max_tiles": 6}, {"max_dynamic_patch": 6}, {"max_tiles": 6, "max_dynamic_patch": 6}):
        request = chat_request(_chat(messages=[{"role": "user", "content": "hi"}], mm_processor_kwargs=kwargs))
        assert request.sampling == {**kwargs, "max_tokens": None}
        assert parse_sampling_parameters(json.dumps(request.sampling)).max_tiles == 6
    request = chat_request(_chat(messages=[{"role": "user", "content": "hi"}],
                                 mm_processor_kwargs={"max_tiles": 2, "max_dynamic_patch": 6}))
    with pytest.raises(ValueError, match="max_tiles 2 and max_dynamic_patch 6 are one setting") as refused:
        parse_sampling_parameters(json.dumps(request.sampling))
    answer = from_orchestrator(str(refused.value))  # the orchestrator's refusal, as the API answers it
    assert (answer.status, answer.param) == (400, "mm_processor_kwargs")


def test_internvls_other_tile_settings_go_on_as_they_are_sent():
    """min_tiles and dynamic_image_size, and vLLM's (min_dynamic_patch) and transformers' (max_patches, min_patches,
    crop_to_patches) names, reach the orchestrator as sent, which reads them as its keys; a value of the wrong JSON
    type that vLLM cannot convert either is a 400 from the schema, naming the field, and so is a flag spelled "no",
    "off" or 0, which pydantic's lax mode would read as false where vLLM's processor takes the string as true."""
    kwargs = {"min_tiles": 2, "min_dynamic_patch": 2, "min_patches": 2, "max_patches": 6, "dynamic_image_size": True,
              "crop_to_patches": True}
    request = chat_request(_chat(messages=[{"role": "user", "content": "hi"}], mm_processor_kwargs=kwargs))
    assert request.sampling == {**kwargs, "max_tokens": None}
    params = parse_sampling_parameters(json.dumps(request.sampling))
    assert (params.min_tiles, params.max_tiles, params.dynamic_image_size) == (2, 6, True)
    for field, value in (("crop_to_patches", "maybe"), ("min_tiles", 1.5), ("dynamic_image_size", "no"),
                         ("crop_to_patches", 0), ("dynamic_image_size", "off")):
        with pytest.raises(ValidationError, match=f"mm_processor_kwargs.{field}"):
            _chat(messages=[{"role": "user", "content": "hi"}], mm_processor_kwargs={field: value})


def test_the_penalties_pass_through_for_the_orchestrator_to_judge():
    request = chat_request(_chat(messages=[{"role": "user", "content": "hi"}], repetition_penalty=1.1,
                                 presence_penalty=0.5, frequency_penalty=0.25, stop_token_ids=[5]))
    assert request.sampling == {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.25,
                                "stop_token_ids": [5], "max_tokens": None}


def test_a_completion_is_a_prompt_without_the_chat_template():
    [request] = completion_requests(CompletionRequest(model="tiny", prompt=["Once upon"], max_tokens=3))
    assert (request.prompt, request.messages, request.media, request.sampling) == ("Once upon", None, (),
                                                                                   {"max_tokens": 3})
    parsed = parse_request(_raw(request), InputLimits())
    assert (parsed.text, parsed.raw, parsed.turns) == ("Once upon", True, ())


def test_a_completions_prompts_are_one_request_each_with_the_same_sampling():
    body = CompletionRequest(model="tiny", prompt=["Once upon", "A", "Once upon"], max_tokens=3, seed=7)
    requests = completion_requests(body)
    assert [r.prompt for r in requests] == ["Once upon", "A", "Once upon"] and body.refusal() is None
    assert all(r.sampling == {"max_tokens": 3, "seed": 7} for r in requests)


@pytest.mark.parametrize("fields,param,words", [
    (dict(n=0), "n", "n: must be in [1, 128], got 0"),
    (dict(n=129), "n", "n: must be in [1, 128], got 129"),
    (dict(n=3, seed=2**63 - 2), "seed", "seed: with n 3, must be below 2**63 - 2"),
    (dict(top_logprobs=2), "top_logprobs", "top_logprobs: only allowed when logprobs is true"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs", "top_logprobs: must be in [0, 20], got 21"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tool_choice",
     'tool_choice: "auto" (the default with tools) needs a tool-call parser'),
    (dict(tool_choice="required"), "tool_choice", 'tool_choice: "required" needs tools'),
    (dict(functions=[{"name": "f", "parameters": {}}]), "functions", "functions: not supported (OpenAI's older tools"),
    (dict(function_call={"name": "f"}), "function_call", "function_call: not supported (OpenAI's older tool_choice"),
    (dict(function_call="auto"), "function_call", "function_call: not supported"),
    (dict(response_format={"type": "xml"}), "response_format", "response_format: type must be text, json_object or"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format",
     "response_format: json_schema.schema must be a JSON schema"),
    (dict(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}), "response_format",
     "response_format: send it or structured_outputs, not both"),
    (dict(stream_options={"include_usage": True}), "stream_options", "stream_options: only allowed when stream"),
])
def test_what_the_server_cannot_do_is_refused(fields, param, words):
    refusal = _chat(messages=[{"role": "user", "content": "hi"}], **fields).refusal()
    assert refusal is not None and refusal[0] == param and refusal[1].startswith(words)


@pytest.mark.parametrize("fields,top,sampling", [
    (dict(), None, None),
    (dict(logprobs=False, top_logprobs=0), None, None),
    (dict(logprobs=True), 0, None),
    (dict(logprobs=True, top_logprobs=3), 3, 3),
])
def test_a_chats_logprobs_ask_for_the_orchestrators_return_logprobs(fields, top, sampling):
    """``logprobs`` true: ``return_logprobs`` and, with ``top_logprobs``, its count as ``sampling_parameters``'
    ``logprobs``; otherwise neither."""
    request = chat_request(_chat(messages=[{"role": "user", "content": "hi"}], **fields))
    assert request.return_logprobs == (top is not None) and request.sampling.get("logprobs") == sampling
    names = [tensor.name() for tensor in request.inputs()]
    assert ("return_logprobs" in names) == (top is not None)


@pytest.mark.parametrize("fields,structured", [
    (dict(response_format={"type": "text"}), None),
    (dict(response_format={"type": "json_object"}), {"json_object": True}),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "integer"}}}),
     {"json": {"type": "integer"}}),
    (dict(structured_outputs={"choice": ["yes", "no"]}), {"choice": ["yes", "no"]}),
])
def test_a_response_format_goes_as_vllms_structured_outputs(fields, structured):
    """OpenAI's ``response_format`` as vLLM converts it, vLLM's ``structured_outputs`` as it is; the orchestrator
    takes both."""
    request = chat_request(_chat(messages=[{"role": "user", "content": "hi"}], **fields))
    assert request.sampling.get("structured_outputs") == structured
    parse_sampling_parameters(json.dumps(request.sampling))
    [completion] = completion_requests(CompletionRequest(model="m", prompt="p", **fields))
    assert completion.sampling.get("structured_outputs") == structured


def test_logit_bias_goes_to_the_orchestrator_as_it_is():
    request = chat_request(_chat(messages=[{"role": "user", "content": "hi"}], logit_bias={"5": 1.5, "7": -100}))
    assert request.sampling == {"logit_bias": {"5": 1.5, "7": -100.0}, "max_tokens": None}


def test_a_completions_logprobs_is_its_top_tokens_count_and_is_checked():
    [request] = completion_requests(CompletionRequest(model="m", prompt="p", logprobs=2))
    assert request.return_logprobs and request.sampling == {"logprobs": 2}
    [zero] = completion_requests(CompletionRequest(model="m", prompt="p", logprobs=0))
    assert zero.return_logprobs and "logprobs" not in zero.sampling
    refusal = CompletionRequest(model="m", prompt="p", logprobs=21).refusal()
    assert refusal == ("logprobs", "logprobs: must be in [0, 20], got 21")


def test_defaults_are_no_refusal():
    assert _chat(messages=[{"role": "user", "content": "hi"}], n=1, logprobs=False, tool_choice="none",
                 response_format={"type": "text"}).refusal() is None
    assert _chat(messages=[{"role": "user", "content": "hi"}], n=128).refusal() is None
    assert CompletionRequest(model="m", prompt="p", echo=False, best_of=1).refusal() is None
    assert CompletionRequest(model="m", prompt="p", echo=True, n=3).refusal() is None
    assert CompletionRequest(model="m", prompt=["a"] * 129).refusal() == (
        "prompt", "prompt: a list of 1 to 128 prompts is taken, got 129")
    assert CompletionRequest(model="m", prompt=["a"] * 65, n=2).refusal() == (
        "n", "n: 2 choices of each of 65 prompts make 130, at most 128")
    assert CompletionRequest(model="m", prompt="p", n=2, seed=2**63 - 2).refusal() is None
    for ids, sent in (([1, 2, 3], [(1, 2, 3)]), ([[1, 2], [3]], [(1, 2), (3,)])):  # vLLM's token-id prompts
        body = CompletionRequest(model="m", prompt=ids)
        requests = completion_requests(body)
        assert body.refusal() is None and [r.prompt_token_ids for r in requests] == sent
        assert all(r.prompt is None for r in requests)
        (tensor,) = [t for t in requests[0].inputs() if t.name() == "prompt_token_ids"]
        assert tensor.datatype() == "INT64" and tensor.shape() == [len(sent[0])]
    for ids, refusal in (([[1], []], "prompt[1]: the token ids are empty"),
                         ([[]], "prompt: the token ids are empty")):
        assert CompletionRequest(model="m", prompt=ids).refusal() == ("prompt", refusal)
    empty = CompletionRequest(model="m", prompt=[])  # converted before it is refused: no IndexError (a 500)
    assert completion_requests(empty) == [] and empty.refusal() == (
        "prompt", "prompt: a list of 1 to 128 prompts is taken, got 0")
    echo = CompletionRequest(model="m", prompt="p", echo=True, logprobs=1)  # the prompt's, as vLLM asks for them
    assert echo.refusal() is None and echo.sampling_parameters()["prompt_logprobs"] == 1
    assert CompletionRequest(model="m", prompt="p", echo=True, logprobs=1, prompt_logprobs=3
                             ).sampling_parameters()["prompt_logprobs"] == 3
    assert "prompt_logprobs" not in CompletionRequest(model="m", prompt="p", logprobs=1).sampling_parameters()
    assert ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "p"}], prompt_logprobs=0
                                 ).sampling_parameters()["prompt_logprobs"] == 0
    streamed = CompletionRequest(model="m", prompt="p", prompt_logprobs=0, stream=True)  # taken, as vLLM takes it
    assert streamed.refusal() is None and "prompt_logprobs" not in streamed.sampling_parameters()  # none would show
    assert CompletionRequest(model="m", prompt="p", echo=True, logprobs=2, prompt_logprobs=0, stream=True
                             ).sampling_parameters()["prompt_logprobs"] == 0  # the streamed echo shows them
    assert ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "p"}], prompt_logprobs=0,
                                 stream=True).refusal() is None
    for body, refusal in ((dict(prompt_logprobs=21), "prompt_logprobs: must be in [0, 20], got 21"),
                          (dict(prompt_logprobs=-1), "prompt_logprobs: must be in [0, 20], got -1"),
                          (dict(prompt_logprobs=1, stream=True), "prompt_logprobs: not available when stream is true")):
        assert CompletionRequest(model="m", prompt="p", **body).refusal() == ("prompt_logprobs", refusal)


@pytest.mark.parametrize("messages,where", [
    ([], "messages"),
    ([{"role": "function", "content": "x"}], "messages.0.role"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "messages.0.content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages.0.content"),
])
def test_malformed_messages_fail_validation_where_they_are(messages, where):
    with pytest.raises(ValidationError) as error:
        _chat(messages=messages)
    assert all(".".join(map(str, e["loc"])).startswith(where) for e in error.value.errors())


def test_stream_options_take_openais_and_vllms_keys_and_ignore_others():
    def options(**given):
        return _chat(messages=[{"role": "user", "content": "x"}], stream=True, stream_options=given)
    assert options(include_usage=True).include_usage and not options(include_usage=True).continuous_usage
    assert options(include_usage=True, continuous_usage_stats=True).continuous_usage
    assert not options(continuous_usage_stats=True).continuous_usage  # vLLM's: only beside include_usage
    assert not options(include_obfuscation=False).include_usage  # OpenAI's, which the SDK sends: ignored
    with pytest.raises(ValidationError, match="include_usage"):
        options(include_usage="maybe")


def test_continuous_usage_asks_each_response_for_the_prompts_tokens_and_the_ids():
    def inputs(**options):
        return {t.name() for t in chat_request(_chat(messages=[{"role": "user", "content": "x"}], stream=True,
                                                     stream_options=options)).inputs()}
    assert {"return_num_input_tokens", "return_output_ids"} <= inputs(include_usage=True, continuous_usage_stats=True)
    assert not {"return_num_input_tokens", "return_output_ids"} & inputs(include_usage=True)
    completion = CompletionRequest.model_validate({"model": "tiny", "prompt": ["a", "b"], "stream": True,
                                                   "stream_options": {"include_usage": True,
                                                                      "continuous_usage_stats": True}})
    assert all(request.continuous_usage for request in completion_requests(completion))


def test_a_tokenize_request_leaves_out_the_token_strings_unless_they_are_wanted():
    """``return_input_tokens`` false only where the API needs no token strings (``/detokenize``, ``/tokenize``
    without ``return_token_strs``); its absence keeps the orchestrator's default, with them."""
    request = dataclasses.replace(chat_request(_chat(messages=[{"role": "user", "content": "x"}])), tokenize_only=True)

    def inputs(r) -> dict:
        return {t.name(): t for t in r.inputs()}
    assert "return_input_tokens" not in inputs(request)
    without = inputs(dataclasses.replace(request, input_tokens=False))["return_input_tokens"]
    assert not np.frombuffer(without._get_content(), dtype=bool)[0]
    assert "return_input_tokens" not in inputs(dataclasses.replace(request, tokenize_only=False, input_tokens=False))


def test_chat_echo_is_the_last_messages_text_where_it_has_the_replys_role():
    """vLLM's chat echo: the assistant's reply role unless add_generation_prompt is false (then the last message's
    own); its text parts joined by line breaks."""
    prefilled = [{"role": "user", "content": "Hi"},
                 {"role": "assistant", "content": [{"type": "text", "text": "The sea"}, {"type": "text", "text": "is"}]}]
    assert _chat(messages=prefilled, echo=True).echoed == "The sea\nis"
    assert _chat(messages=prefilled).echoed == ""
    assert _chat(messages=[{"role": "user", "content": "Hi"}], echo=True).echoed == ""
    assert _chat(messages=[{"role": "user", "content": "Hi"}], echo=True, add_generation_prompt=False).echoed == "Hi"


def test_a_null_or_absent_content_is_a_message_without_parts_as_the_orchestrator_reads_it():
    request = chat_request(_chat(messages=[{"role": "user", "content": ""}, {"role": "assistant", "content": None},
                                           {"role": "assistant"}, {"role": "user", "content": "Go on."}]))
    turns = parse_request(_raw(request), InputLimits()).turns
    assert [(turn.role, turn.parts) for turn in turns] == [("user", (Part("text", ""),)), ("assistant", ()),
                                                           ("assistant", ()), ("user", (Part("text", "Go on."),))]


def test_flags_sent_as_null_are_false_and_other_types_are_refused_unless_vllm_converts_them():
    request = _chat(messages=[{"role": "user", "content": "x"}], stream=None, return_token_ids=None,
                    return_timeline=None)
    assert (request.stream, request.return_token_ids, request.return_timeline) == (False, False, False)
    assert not _raw(chat_request(request)).stream
    for value in ("maybe", 2, [True]):
        with pytest.raises(ValidationError, match="return_timeline"):
            _chat(messages=[{"role": "user", "content": "x"}], return_timeline=value)


def test_values_are_converted_as_vllms_request_models_convert_them():
    """vLLM 0.26's request models validate in pydantic's lax mode: numeric strings and whole floats are numbers,
    "true" / "false" booleans, as a client written for vLLM may send them."""
    request = _chat(messages=[{"role": "user", "content": "x"}], max_tokens="5", temperature="0.5", n="2",
                    seed=3.0, stream="false", logprobs="true", top_logprobs=2.0)
    assert (request.max_tokens, request.temperature, request.n, request.seed) == (5, 0.5, 2, 3)
    assert (request.stream, request.logprobs, request.top_logprobs) == (False, True, 2)


def test_return_timeline_goes_to_the_orchestrator_with_the_output_ids():
    inputs = {t.name() for t in chat_request(_chat(messages=[{"role": "user", "content": "x"}],
                                                   return_timeline=True)).inputs()}
    assert {"return_timeline", "return_output_ids"} <= inputs  # the ids: each chunk's tokens on the timeline
    plain = {t.name() for t in chat_request(_chat(messages=[{"role": "user", "content": "x"}])).inputs()}
    assert not {"return_timeline", "return_output_ids"} & plain


def test_a_chats_template_fields_go_as_chat_template_kwargs_the_fields_over_the_dict():
    plain = chat_request(_chat(messages=[{"role": "user", "content": "hi"}]))
    assert plain.chat_template_kwargs is None and "chat_template_kwargs" not in [i.name() for i in plain.inputs()]
    request = chat_request(_chat(messages=[{"role": "assistant", "content": "It is"}], add_generation_prompt=False,
                                 continue_final_message=True,
                                 chat_template_kwargs={"add_vision_id": True, "add_generation_prompt": True}))
    assert json.loads(request.chat_template_kwargs) == {"add_vision_id": True, "add_generation_prompt": False,
                                                        "continue_final_message": True}  # vLLM's merge
    parsed = parse_request(_raw(request), InputLimits())
    assert (parsed.chat.add_generation_prompt, parsed.chat.continue_final_message) == (False, True)


def test_max_completion_tokens_out_of_range_is_refused_under_its_own_name():
    for value in (-3, 0, 2**31):
        field, message = _chat(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=value).refusal()
        assert field == "max_completion_tokens" and message.startswith("max_completion_tokens: must be a positive")
    assert _chat(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=5).refusal() is None


def test_a_requests_own_chat_template_is_refused_naming_it():
    field, message = _chat(messages=[{"role": "user", "content": "hi"}], chat_template="{{ 'X' }}").refusal()
    assert field == "chat_template" and "its own template only" in message


def test_the_field_that_holds_the_output_rule_goes_with_the_request():
    def held(**fields):
        return chat_request(_chat(messages=[{"role": "user", "content": "x"}], **fields)).structured_as
    assert held(response_format={"type": "json_object"}) == "response_format"
    assert held(structured_outputs={"regex": "a+"}) == held() == held(response_format={"type": "text"}) == \
        "structured_outputs"
