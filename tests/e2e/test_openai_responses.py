"""The Responses API (``POST /v1/responses``) through a real tritonserver, driven with the ``openai`` SDK as a user
drives it (``responses.create``, ``responses.stream``): a response is the chat completion of its messages (the same
greedy text and token counts), its stream's events reassemble to the whole reply, images and structured outputs
are served as a chat's, a client going away cancels its request, a stream that fails midway ends with OpenAI's
``error`` event, and what vLLM 0.26 refuses, or this server cannot serve (stored responses too), is an error naming
the field."""
from __future__ import annotations

import json
import operator
import threading
import urllib.request

import httpx
import openai
import pytest

from tests.e2e import test_openai_api as shared
from tests.e2e.conftest import assert_closing_cancels, serve
from tests.e2e.test_openai_api import MODEL, _api, _data_url
from tests.media import make_image

pytestmark = pytest.mark.e2e
N = 8
api, sdk = shared.api, shared.sdk  # fixtures: the module's API process and SDK client
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}  # random weights: counts and text asserted only so


def _chat(sdk, messages: list[dict], **fields):
    return sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=N, **GREEDY, **fields)


def test_a_response_is_the_chat_completion_of_its_instructions_and_input(sdk):
    response = sdk.responses.create(model=MODEL, instructions="Be brief.", input="Tell me a story.",
                                    max_output_tokens=N, metadata={"run": "1"}, **GREEDY)
    chat = _chat(sdk, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}])
    assert response.id.startswith("resp_") and response.model == MODEL and response.metadata == {"run": "1"}
    assert response.output_text == chat.choices[0].message.content
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens, N)
    assert response.usage.total_tokens == chat.usage.prompt_tokens + N


def test_message_items_with_an_image_are_the_chats_messages(sdk):
    image = _data_url(make_image(64, 48, "RGB", "PNG"), "image/png")
    response = sdk.responses.create(model=MODEL, max_output_tokens=N, **GREEDY, input=[
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": [{"type": "input_image", "image_url": image},
                                     {"type": "input_text", "text": "What is it?"}]}])
    chat = _chat(sdk, [{"role": "system", "content": "Answer in one word."},
                       {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                    {"type": "text", "text": "What is it?"}]}])
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens > 40  # the image's visual tokens counted


def test_a_streamed_response_reassembles_to_the_whole_one(sdk):
    whole = sdk.responses.create(model=MODEL, input="Count to ten.", max_output_tokens=N, **GREEDY)
    with sdk.responses.stream(model=MODEL, input="Count to ten.", max_output_tokens=N, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) <= {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.status == "incomplete" and final.usage.output_tokens == N and final.id == events[0].response.id


def test_create_with_stream_true_yields_the_same_events(sdk):
    events = list(sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=2, stream=True, **GREEDY))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert events[-1].response.usage.output_tokens == 2


def test_each_event_is_named_on_its_sse_line_and_no_done_follows(api):
    """As OpenAI and vLLM write them: ``event: <type>`` then ``data: <the event>``, and no ``data: [DONE]``."""
    body = json.dumps({"model": MODEL, "input": "Hi", "max_output_tokens": 2, "stream": True, "temperature": 0,
                       "ignore_eos": True}).encode()
    sent = urllib.request.Request(f"{api.url}/v1/responses", body, {"Content-Type": "application/json"})
    lines = urllib.request.urlopen(sent, timeout=60).read().decode().splitlines()
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [event["type"] for event in data] and names[0] == "response.created"
    assert names[-1] == "response.completed" and "[DONE]" not in "".join(lines)


def test_text_format_json_schema_holds_the_reply_to_the_schema(sdk):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    response = sdk.responses.create(model=MODEL, input="Is it raining?", max_output_tokens=200, temperature=0,
                                    text={"format": {"type": "json_schema", "name": "reply", "schema": schema}})
    assert response.status == "completed" and json.loads(response.output_text)["answer"] in ("yes", "no")


def test_include_logprobs_gives_each_tokens_log_probability(sdk):
    response = sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=N, top_logprobs=2,
                                    include=["message.output_text.logprobs"], **GREEDY)
    logprobs = response.output[0].content[0].logprobs
    assert len(logprobs) == N and all(len(token.top_logprobs) == 2 and token.logprob <= 0 for token in logprobs)


def test_a_client_that_goes_away_has_its_response_cancelled(sdk, server):
    stream = sdk.responses.create(model=MODEL, input="Go on forever.", max_output_tokens=20000, stream=True,
                                  **GREEDY)
    for _, _event in zip(range(6), stream):
        pass
    assert_closing_cancels(server, stream)


@pytest.mark.parametrize("fields, error, param, words", [
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}, openai.BadRequestError,
     "tools", "tool-call parser"),
    ({"background": True}, openai.BadRequestError, "background", "stores no responses"),
    ({"tool_choice": "required"}, openai.BadRequestError, "tool_choice", "needs tools"),
    ({"previous_response_id": "resp_1"}, openai.NotFoundError, "previous_response_id", "stores no responses"),
    ({"model": "gpt-4o"}, openai.NotFoundError, "model", "does not exist"),
    ({"max_output_tokens": 0}, openai.BadRequestError, "max_output_tokens", "max_output_tokens"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
     openai.BadRequestError, "input", "input[0].content[0].image_url: "),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "21"}]}, openai.BadRequestError,
     "input", "only message items are served"),
    ({"conversation": "conv_1"}, openai.BadRequestError, "conversation", "stores no conversations"),
    ({"tool_choice": "bogus"}, openai.BadRequestError, "tool_choice", "must be"),
    ({"top_logprobs": -1}, openai.BadRequestError, "top_logprobs", "must be in [0, 20]"),
])
def test_what_is_not_served_is_an_error_naming_the_field(sdk, fields, error, param, words):
    with pytest.raises(error) as refused:
        sdk.responses.create(**{"model": MODEL, "input": "Hi", "max_output_tokens": 2, **fields})
    body = refused.value.body
    assert body["param"] == param and words in body["message"], body


@pytest.mark.parametrize("call", ["retrieve", "delete", "cancel", "input_items.list"])
def test_a_stored_response_is_not_found(sdk, call):
    """Nothing is stored (vLLM 0.26's default): the SDK's calls on a stored response raise NotFoundError."""
    with pytest.raises(openai.NotFoundError) as missing:
        operator.attrgetter(call)(sdk.responses)("resp_1")
    assert missing.value.body["message"].startswith("Response with id 'resp_1' not found"), missing.value.body


def test_a_stream_that_fails_midway_ends_with_an_error_event(media_dir, tmp_path):
    """A stream in flight when its tritonserver stops (as the launcher stops it on SIGINT) ends with OpenAI's
    ``error`` event, named on its SSE line and numbered after the events before it, with the orchestrator's
    "shutting down" error; nothing follows it."""
    lines: list[str] = []
    outcome: dict[str, object] = {}
    streaming = threading.Event()
    body = {"model": MODEL, "input": "Tell me everything.", "max_output_tokens": 20000, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with serve(media_dir, idle_at_exit=False) as srv, _api(srv.ports.grpc, tmp_path / "api.log") as process:

        def read() -> None:
            try:
                with httpx.stream("POST", f"{process.url}/v1/responses", json=body, timeout=60) as answer:
                    outcome["status"] = answer.status_code
                    for line in answer.iter_lines():
                        lines.append(line)
                        if line == "event: response.output_text.delta":
                            streaming.set()
            except httpx.HTTPError as exc:
                outcome["error"] = exc

        reading = threading.Thread(target=read)
        reading.start()
        assert streaming.wait(120), f"the stream brought no text: {outcome} {lines[:8]}"
        srv.stop()
        reading.join(timeout=30)
        assert not reading.is_alive(), "the stream did not end when the server stopped"
    assert outcome == {"status": 200}, outcome  # the stream ended cleanly
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [event["type"] for event in data] and names[-1] == "error" and "response.completed" not in names
    assert [event["sequence_number"] for event in data] == list(range(len(data)))
    error = data[-1]
    assert error["code"] == "service_unavailable" and "shutting down" in error["message"], error
    assert set(error) == {"type", "sequence_number", "code", "message", "param"}
