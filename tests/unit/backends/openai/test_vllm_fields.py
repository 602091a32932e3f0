"""vLLM's request fields and shapes beside OpenAI's (backends/openai/schemas.py, unsupported.py, app.py): those this
server cannot honour are refused when set (never ignored into a different result), vLLM's simple media parts are
taken, and /v1/models cards carry vLLM's root, parent and permission."""
from __future__ import annotations

import asyncio
import json
import logging

import pytest
from fastapi.testclient import TestClient

from backends.openai.app import ApiState, create_app
from backends.openai.config import ApiConfig
from backends.openai.convert import MediaRef, chat_request
from backends.openai.schemas import ChatCompletionRequest, CompletionRequest

HI = [{"role": "user", "content": "hi"}]
NOWHERE = "127.0.0.1:27999"  # no tritonserver: these answers come before the API asks it anything

# (field, value that is refused, value that passes as the default does, words the message holds after "field: ")
REFUSED = [
    ("use_beam_search", True, False, "beam search is not supported"),
    ("priority", 5, 0, "got 5 but priority scheduling is not enabled"),
    ("priority", -1, None, "got -1 but priority scheduling is not enabled"),
    ("watermarking", True, False, "watermarking is not supported"),
    ("truncate_prompt_tokens", 10, None, "prompt truncation is not supported"),
    ("allowed_token_ids", [1, 2], None, "not supported by this server (logit_bias"),
    ("bad_words", ["sea"], [], "not supported by this server (logit_bias"),
    ("logprob_token_ids", [3], None, "not supported by this server"),
    ("return_tokens_as_token_ids", True, False, "not supported by this server (return_token_ids"),
    ("repetition_detection", {"max_pattern_size": 4}, None, "not supported by this server"),
]


@pytest.mark.parametrize("field,refused,passes,words", REFUSED, ids=[f"{r[0]}={r[1]}" for r in REFUSED])
def test_vllm_fields_this_server_cannot_honour_are_refused_unless_left_at_their_defaults(field, refused, passes,
                                                                                          words):
    for body in (ChatCompletionRequest.model_validate({"model": "m", "messages": HI, field: refused}),
                 CompletionRequest.model_validate({"model": "m", "prompt": "p", field: refused})):
        named, message = body.refusal()
        assert named == field and message.startswith(f"{field}: {words}"), message
    given = {} if passes is None else {field: passes}
    assert ChatCompletionRequest.model_validate({"model": "m", "messages": HI, **given}).refusal() is None
    assert CompletionRequest.model_validate({"model": "m", "prompt": "p", **given}).refusal() is None


def test_each_endpoints_own_unsupported_fields_are_refused_there():
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": HI,
                                                 "media_io_kwargs": {"video": {"num_frames": 8}}})
    assert chat.refusal()[0] == "media_io_kwargs" and "mm_processor_kwargs" in chat.refusal()[1]
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "p", "prompt_embeds": "AAAA"})
    assert completion.refusal() == ("prompt_embeds", "prompt_embeds: prompt embeddings are not supported by this "
                                                     "server (send the prompt as text or token ids)")
    assert ChatCompletionRequest.model_validate({"model": "m", "messages": HI, "use_beam_search": None,
                                                 "length_penalty": 1.0}).refusal() is None  # null: the default


def test_vllms_simple_media_parts_are_taken_as_their_url():
    """vLLM's ``{"image_url": "<url>"}`` / ``{"video_url": "<url>"}`` (its simple parts, type left out), and the same
    plain string under a ``type``, are the URL as ``{"url": <url>}`` gives it."""
    content = [{"type": "image_url", "image_url": "https://x/a.png"}, {"type": "video_url", "video_url": "/v.mp4"},
               {"image_url": "data:,"}, {"type": None, "video_url": {"url": "/w.mp4"}},  # a null type: left out
               {"type": "text", "text": "Same?"}]
    request = chat_request(ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": content}]}))
    assert request.media == (MediaRef("image", "https://x/a.png", "messages[0].content[0].image_url"),
                             MediaRef("video", "/v.mp4", "messages[0].content[1].video_url"),
                             MediaRef("image", "data:,", "messages[0].content[2].image_url"),
                             MediaRef("video", "/w.mp4", "messages[0].content[3].video_url"))
    assert '[{"type": "image"}, {"type": "video"}, {"type": "image"}, {"type": "video"}, {"type": "text"' \
        in request.messages


def test_refusal_input_text_and_output_text_parts_are_text():
    """As vLLM's chat parser reads them: a ``refusal`` part (OpenAI's SDK sends an assistant's refusal back so) is its
    ``refusal``'s text, ``input_text`` and ``output_text`` parts (the Responses API's names) their ``text``; an echo
    repeats them."""
    messages = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."},
                                                  {"type": "output_text", "text": "Sorry."}]}]
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, "echo": True,
                                                 "add_generation_prompt": False})
    assert json.loads(chat_request(body).messages) == [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "No."}, {"type": "text", "text": "Sorry."}]}]
    assert body.echoed == "No.\nSorry."


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(ApiConfig(grpc_url=NOWHERE))) as c:
        yield c


@pytest.mark.parametrize("part,words", [
    ({"type": "input_audio", "input_audio": {}}, "messages[0].content[0]: Input should be a part of type 'text', "
                                                 "'image_url', 'video_url' or 'refusal'"),
    ({"text": "no type"}, "messages[0].content[0]: Input should be a part of type 'text', 'image_url', 'video_url' "
                          "or 'refusal'"),
    ({"type": "refusal"}, "messages[0].content[0].refusal: Field required"),
    ({"type": "image_url", "image_url": {}}, "messages[0].content[0].image_url.url: Field required"),
])
def test_a_part_of_no_known_type_is_400_naming_it(client, part, words):
    answer = client.post("/v1/chat/completions",
                         json={"model": "m", "messages": [{"role": "user", "content": [part]}]})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages"
    assert words in answer.json()["error"]["message"], answer.json()


def test_a_model_card_has_vllms_root_parent_and_permission():
    """root: the model as the server loaded it (the checkpoint's path; the id is its folder's name), parent null,
    permission one entry with vLLM's ModelPermission defaults."""
    async def card(params: dict[str, str], **settings) -> dict:
        state = ApiState(ApiConfig(grpc_url=NOWHERE, **settings))

        async def parameters():
            return params
        state.orchestrator.parameters = parameters
        try:
            return (await state.model_card()).model_dump()
        finally:
            await state.close()

    checkpoint = asyncio.run(card({"model_path": "/models/Qwen2.5-VL-3B-Instruct", "max_model_len": "32768"}))
    assert (checkpoint["id"], checkpoint["root"], checkpoint["parent"]) == (
        "Qwen2.5-VL-3B-Instruct", "/models/Qwen2.5-VL-3B-Instruct", None)
    (permission,) = checkpoint["permission"]
    assert permission["id"].startswith("modelperm-") and permission["object"] == "model_permission"
    assert {key: value for key, value in permission.items() if key not in ("id", "object", "created")} == {
        "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False,
        "allow_view": True, "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}
    preset = asyncio.run(card({"preset": "tiny"}, served_model_names=("mine",)))
    assert (preset["id"], preset["root"]) == ("mine", "tiny")


@pytest.mark.parametrize("names, listed, taken, refused", [
    # vLLM's default name is its --model as given: the path as loaded is taken too
    ((), ["Qwen2.5-VL-3B-Instruct"], ["Qwen2.5-VL-3B-Instruct", "/models/Qwen2.5-VL-3B-Instruct"], ["Qwen"]),
    # --served-model-name: those names only, a card each, the first in replies
    (("qwen", "Qwen/Qwen2.5-VL-3B-Instruct"), ["qwen", "Qwen/Qwen2.5-VL-3B-Instruct"],
     ["qwen", "Qwen/Qwen2.5-VL-3B-Instruct"], ["Qwen2.5-VL-3B-Instruct", "/models/Qwen2.5-VL-3B-Instruct"]),
])
def test_the_names_a_client_may_send(names, listed, taken, refused):
    async def run():
        state = ApiState(ApiConfig(grpc_url=NOWHERE, served_model_names=names))

        async def parameters():
            return {"model_path": "/models/Qwen2.5-VL-3B-Instruct"}
        state.orchestrator.parameters = parameters
        try:
            cards = [card.id for card in await state.model_cards()]
            return cards, (await state.model_card()).id, [await state.serves(m) for m in taken + refused]
        finally:
            await state.close()

    cards, first, served = asyncio.run(run())
    assert cards == listed and first == listed[0]
    assert served == [True] * len(taken) + [False] * len(refused)


def test_the_fields_a_request_has_that_this_server_does_not_know_are_logged(caplog):
    """vLLM warns of them: a misspelt field (max_token), or another server's (guided_choice), shows in the log; vLLM's
    own that change nothing here (user) do not."""
    with caplog.at_level(logging.WARNING, logger="backends.openai.ignored_fields"):
        ChatCompletionRequest.model_validate({"messages": HI, "max_token": 4, "guided_choice": ["a"], "top_k": 2,
                                              "user": "u1"})
        CompletionRequest.model_validate({"prompt": "x", "max_tokens": 4})
    (record,) = caplog.records
    assert record.getMessage() == "ChatCompletionRequest: fields ignored (unknown to this server): guided_choice, " \
                                  "max_token"
