"""Errors in OpenAI's shape and their statuses (backends/openai/errors.py): the orchestrator's own messages, made by
its own validation code, and real transport failures (nothing listens at the gRPC address)."""
from __future__ import annotations

import asyncio
import socket

import pytest
from tritonclient.utils import InferenceServerException

from backends.openai.convert import MediaRef, OrchestratorRequest
from backends.openai.errors import ApiError, from_orchestrator, from_transport
from orchestrator.chat_options import parse_chat_options
from backends.openai.orchestrator_client import OrchestratorClient
from backends.runtime.tokenizer import build_offline_tokenizer
from backends.triton.triton_io import naming_request
from flashcodec.families import MediaOptions, family
from flashcodec.probe import ImageInfo
from orchestrator.engine_io import SHUTTING_DOWN
from orchestrator.service import OVERLOADED
from orchestrator.inputs import InputLimits, MediaInput, RawRequest, parse_request
from orchestrator.media import check_media_settings, plan_media
from orchestrator.prompt import QWEN, build_prompt, build_raw_prompt
from orchestrator.sampling_params import InvalidInput, RequestParams, parse_sampling_parameters
from orchestrator.visual_cap import fit_visual_tokens
from tests.media import make_image


def _message(call) -> str:
    with pytest.raises(InvalidInput) as error:
        call()
    return str(error.value)


def _orchestrator_messages() -> list[tuple[str, str]]:
    """(message, expected param) of InvalidInput raised by the orchestrator's code."""
    prompt = build_prompt(build_offline_tokenizer(), "Hello", [])
    return [
        (_message(lambda: parse_request(RawRequest(text_input=[b" "]), InputLimits())), "prompt"),
        (_message(lambda: parse_request(RawRequest(text_input=[], messages=[b"[]"]), InputLimits())), "messages"),
        (_message(lambda: parse_request(RawRequest(text_input=[b"x"], image_url=[b"/etc/passwd"]), InputLimits())),
         "messages"),
        (_message(lambda: parse_sampling_parameters('{"top_k": -5}')), "top_k"),
        (_message(lambda: parse_sampling_parameters('{"presence_penalty": 5}')), "presence_penalty"),
        (_message(lambda: plan_media(MediaInput("image", data=b"GIF89a-broken", input="image_url"),
                                     RequestParams(), QWEN)), "messages"),
        (_message(lambda: plan_media(MediaInput("image", data=b"GIF89a-broken", input="image_url",
                                                position="item 2 of 3"), RequestParams(), QWEN)), "messages"),
        (_message(lambda: check_media_settings(RequestParams(max_tiles=2), QWEN)), "max_tiles"),
        (_message(lambda: plan_media(MediaInput("image", data=make_image(64, 48), input="image_url"),
                                     RequestParams(min_tiles=13), family("internvl3"))), "min_tiles"),
        (_message(lambda: prompt.check_length(10**6, 100)), "max_tokens"),
        (_message(lambda: prompt.check_length(1, 5)), "prompt"),
        (_message(lambda: parse_request(RawRequest(text_input=[], prompt=[b" "]), InputLimits())), "prompt"),
        (_message(lambda: build_raw_prompt(build_offline_tokenizer(), "<|image_pad|>")), "prompt"),
        (_message(lambda: fit_visual_tokens(QWEN, [ImageInfo(640, 480, "RGB", "PNG")] * 3, MediaOptions(), 5)), "messages"),
        (_message(lambda: parse_chat_options([b'{"continue_final_message": true}'])), "add_generation_prompt"),
        (_message(lambda: parse_chat_options([b'{"continue_final_message": 2, "add_generation_prompt": false}'])),
         "continue_final_message"),
        (_message(lambda: parse_chat_options([b'{"tokenize": true}'])), "chat_template_kwargs"),
    ]


def test_the_orchestrators_validation_messages_are_400_with_the_field():
    for message, param in _orchestrator_messages():
        # the orchestrator names the API's request id after its message (triton_io.naming_request): not answered
        error = from_orchestrator(naming_request(message, "4f0c"))
        media = param in ("max_tiles", "min_tiles")  # sent in mm_processor_kwargs, the field named
        param = "mm_processor_kwargs" if media else param
        assert (error.status, error.param) == (400, param), message
        sent = message.removeprefix("sampling_parameters: ")  # an OpenAI client sends no sampling_parameters
        sent = f"mm_processor_kwargs.{sent}" if media else sent
        assert error.body() == {"error": {"message": sent, "type": "invalid_request_error", "param": param,
                                          "code": None}}


def test_a_chats_prompt_length_error_names_messages():
    """A chat has no ``prompt`` field: the orchestrator's errors about the prompt's length name its ``messages``;
    a completion's name ``prompt`` (a fresh user's test)."""
    for message in ("prompt too long: its 34052 tokens (34052 text tokens) leave no room for output within "
                    "max_model_len 32768 (shorten the prompt)",
                    "the prompt (40001 tokens, text and visual) needs 2501 KV pages ..."):
        assert from_orchestrator(message, chat=True).param == "messages"
        assert from_orchestrator(message).param == "prompt"


def test_a_sampling_keys_message_names_the_field_as_an_openai_client_sent_it():
    """The API sends the request's sampling fields and mm_processor_kwargs as the orchestrator's sampling_parameters:
    a refusal names what the client sent, a media setting under mm_processor_kwargs."""
    for body, words in (('{"fps": 100}', "mm_processor_kwargs.fps must be in (0, 60], got 100"),
                        ('{"max_pixels": 10}', "mm_processor_kwargs.max_pixels must be"),
                        ('{"min_patches": 0}',
                         "mm_processor_kwargs.min_tiles must be in [1, 64] (an InternVL3 setting), got 0"),
                        ('{"crop_to_patches": "x"}', "mm_processor_kwargs.crop_to_patches must be a boolean"),
                        ('{"top_k": -5}', "top_k must be")):
        error = from_orchestrator(_message(lambda: parse_sampling_parameters(body)))
        assert error.message.startswith(words) and error.status == 400, error.message
        assert error.param == ("top_k" if "top_k" in body else "mm_processor_kwargs"), error.param


def test_a_structured_output_sent_as_response_format_is_named_as_sent():
    """A chat's response_format goes as the orchestrator's structured_outputs: its refusal names response_format
    (the schema as response_format.json_schema.schema); a request that sent structured_outputs keeps that name."""
    schema = 'sampling_parameters: structured_outputs.json: Unsupported type "foo"'
    error = from_orchestrator(schema, structured_as="response_format")
    assert (error.param, error.message) == ("response_format",
                                            'response_format.json_schema.schema: Unsupported type "foo"')
    error = from_orchestrator("sampling_parameters: structured_outputs: no output can match it",
                              structured_as="response_format")
    assert (error.param, error.message) == ("response_format", "response_format: no output can match it")
    error = from_orchestrator(schema)
    assert (error.param, error.message) == ("structured_outputs", 'structured_outputs.json: Unsupported type "foo"')


def test_a_media_items_error_names_its_part_of_the_chat():
    """The orchestrator numbers a request's items in placeholder order, as the chat's media are: ``image_url (item 2
    of 3)`` is the second part with media; a request's only item has no number; a number that does not fit (or a
    kind that differs) leaves the message as it is."""
    media = [MediaRef("video", "v", "messages[0].content[1].video_url"),
             MediaRef("image", "i", "messages[2].content[0].image_url")]
    error = from_orchestrator("image_url (item 2 of 2): not a decodable image (JPEG, PNG, WebP, ...)", media)
    assert (error.status, error.param) == (400, "messages")
    assert error.message == "messages[2].content[0].image_url: not a decodable image (JPEG, PNG, WebP, ...)"
    only = from_orchestrator("video_url: no such file", media[:1])
    assert only.message == "messages[0].content[1].video_url: no such file"
    for message in ("image_url (item 1 of 2): x", "image_url (item 5 of 5): x", "image_url: x"):
        assert from_orchestrator(message, media).message == message
    assert from_orchestrator("image_url: x").message == "image_url: x"  # no media known (a KServe-style caller)


@pytest.mark.parametrize("message,status", [
    (SHUTTING_DOWN, 503),
    (f"{SHUTTING_DOWN} (its model decode was unloaded; ...)", 503),  # a stage unloaded alone (server_stop)
    ("flashcodec: RuntimeError: worker died", 500),
    ("decode: the decode step failed", 500),
    ("internal error: KeyError: 'x'", 500),
    ("encode_prefill: OutOfMemoryError: CUDA out of memory", 500),
])
def test_server_faults_are_5xx(message, status):
    error = from_orchestrator(message)
    assert error.status == status and error.body()["error"]["type"] == "server_error"


def test_a_full_waiting_queue_is_overloaded_as_the_apis_own_limit_and_a_stop_is_unavailable():
    """A client backing off on ``overloaded`` and failing over on ``service_unavailable`` (a fresh user's case)."""
    full = from_orchestrator(f"{OVERLOADED}: 16 requests wait for KV pages, of at most 16 (...)")
    assert (full.status, full.code) == (503, "overloaded")
    assert from_orchestrator(SHUTTING_DOWN).code == "service_unavailable"


def _unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_an_unreachable_server_is_503():
    async def attempts():
        client = OrchestratorClient(f"127.0.0.1:{_unused_port()}", "orchestrator")
        try:
            assert not await client.ready()
            with pytest.raises(ApiError) as config_error:
                await client.parameters()
            with pytest.raises(ApiError) as stream_error:
                async for _ in client.generate(OrchestratorRequest("hi", None, (), {}, True, False)):
                    pass
        finally:
            await client.close()
        return config_error.value, stream_error.value

    for error in asyncio.run(attempts()):
        assert error.status == 503 and error.code == "service_unavailable", error.message


def test_a_server_without_the_orchestrator_loaded_is_503():
    """Triton's answer while the orchestrator is unloaded or unloading (explicit model control: a fresh user's test
    got 500), as tritonclient raises it; another NOT_FOUND stays 500."""
    missing = InferenceServerException("Request for unknown model: 'orchestrator' has no available versions",
                                       status="StatusCode.NOT_FOUND")
    error = from_transport(missing)
    assert error.status == 503 and error.body()["error"]["code"] == "service_unavailable"
    assert "orchestrator model is not loaded" in error.message and "no available versions" in error.message
    assert from_transport(InferenceServerException("something else", status="StatusCode.NOT_FOUND")).status == 500


def test_the_channel_retries_a_lost_tritonserver_within_a_second():
    """gRPC's default reconnect backoff grows to 120 s: the standalone API answered 503 for 7.4 s after a
    tritonserver that came up after it was ready, 0.4 s with these options (by hand, 2026-12-07); tritonclient's own
    options kept beside them."""
    from backends.openai.orchestrator_client import _CHANNEL_ARGS

    args = dict(_CHANNEL_ARGS)
    assert args["grpc.max_reconnect_backoff_ms"] <= 1000 and args["grpc.initial_reconnect_backoff_ms"] <= 1000
    assert args["grpc.max_receive_message_length"] == 2**31 - 1 and "grpc.keepalive_timeout_ms" in args
