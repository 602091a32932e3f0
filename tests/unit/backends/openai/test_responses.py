"""The orchestrator's responses -> OpenAI's bodies (backends/openai/responses.py): text, token ids, usage, what
max_visual_tokens lowered, what was done with each media item and the request's timeline, whole and streamed."""
import dataclasses
import json

from backends.openai.responses import ChatShape, CompletionShape, Reply
from client.pieces import ResponsePiece

CAP = {"max_visual_tokens": 400, "requested_visual_tokens": 1152, "visual_tokens": 384, "fps": 0.6,
       "max_pixels": [None]}
TIMELINE = {"events": [{"ms": 0.4, "event": "parsed"}, {"ms": 9.5, "event": "first_token"}]}
MEDIA = [{"kind": "video", "grid_thw": [1, 20, 28], "visual_tokens": 140, "frames_in_file": 1, "duration_s": 0.1,
          "frames": 1, "sampled_frames": 2, "fps": 20.0}]
PIECES = [ResponsePiece(b"Hel", (1, 2), visual_cap=CAP, media=MEDIA), ResponsePiece(b"lo", (3,)),
          ResponsePiece(b"", (), num_input_tokens=500, num_output_tokens=3, num_cached_tokens=480,
                        finish_reason="length", final=True, timeline=TIMELINE)]


def sent(body) -> dict:
    """A body as the API writes it (``model_dump_json``)."""
    return json.loads(body.model_dump_json())


def test_a_whole_chat_reply_carries_text_ids_usage_the_visual_cap_and_media():
    reply = Reply()
    for piece in PIECES:
        reply.add(piece)
    body = sent(ChatShape("tiny", return_token_ids=True).whole([reply]))
    assert body["choices"][0]["message"]["content"] == "Hello" and body["choices"][0]["token_ids"] == [1, 2, 3]
    assert body["usage"] == {"prompt_tokens": 500, "completion_tokens": 3, "total_tokens": 503,
                             "prompt_tokens_details": {"cached_tokens": 480}}  # OpenAI's field, as vLLM fills it
    assert body["visual_cap"] == CAP and body["media"] == MEDIA and body["timeline"] == TIMELINE


def test_the_first_streamed_chunk_carries_the_visual_cap_and_media_and_the_others_do_not():
    shape = ChatShape("tiny", return_token_ids=False)
    chunks = [sent(shape.chunk(0, piece)) for piece in PIECES]
    assert chunks[0]["visual_cap"] == CAP and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[0]["media"] == MEDIA
    assert all("visual_cap" not in c and "media" not in c for c in chunks[1:])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chunks_write_openais_nullable_fields_as_null_and_the_extras_only_when_set():
    """OpenAI's chunk choices always have ``finish_reason`` (null until the last) and ``logprobs``; the role is on a
    choice's first delta only; token ids, usage, and our extras appear only when there is one (vLLM's chunks)."""
    for shape in (ChatShape("tiny", return_token_ids=False), CompletionShape("tiny", return_token_ids=False)):
        chunks = [sent(shape.chunk(0, piece)) for piece in PIECES]
        for chunk in chunks:
            choice = chunk["choices"][0]
            assert {"index", "logprobs", "finish_reason", "stop_reason"} <= set(choice) and "token_ids" not in choice
            assert "usage" not in chunk and choice["logprobs"] is None and choice["stop_reason"] is None
        assert [chunk["choices"][0]["finish_reason"] for chunk in chunks] == [None, None, "length"]
        if isinstance(shape, ChatShape):
            assert [set(chunk["choices"][0]["delta"]) for chunk in chunks] == [{"role", "content"}, {"content"}, {"content"}]


def test_continuous_usage_gives_every_chunk_its_choices_usage_so_far():
    """vLLM's continuous_usage_stats: per choice, the prompt's tokens and the choice's tokens so far; its last
    chunk's is the whole usage. Every chunk's usage has the prompt's cached tokens, as the last one has them (the
    orchestrator sends them with the prompt's tokens). Without it no chunk carries usage (the usage-only chunk comes
    apart)."""
    pieces = [dataclasses.replace(piece, num_input_tokens=500, num_cached_tokens=480) for piece in PIECES]
    for shape in (ChatShape("tiny", False, continuous_usage=True), CompletionShape("tiny", False,
                                                                                   continuous_usage=True)):
        usages = [sent(shape.chunk(0, piece))["usage"] for piece in pieces]
        assert [(u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) for u in usages] == [
            (500, 2, 502), (500, 3, 503), (500, 3, 503)]
        assert [u["prompt_tokens_details"] for u in usages] == [{"cached_tokens": 480}] * 3
        other = sent(shape.chunk(1, dataclasses.replace(pieces[1], token_ids=(7, 8, 9))))["usage"]
        assert other["completion_tokens"] == 3  # choice 1's own
    assert all("usage" not in sent(ChatShape("tiny", False).chunk(0, piece)) for piece in pieces)


def test_chat_echo_starts_each_choices_message_and_first_chunk():
    shape = ChatShape("tiny", False, n=2, echo="The sea ")
    assert [c.message.content for c in shape.whole([_reply(PIECES), _reply(PIECES)]).choices] == ["The sea Hello"] * 2
    streamed = [(index, shape.chunk(index, piece).choices[0].delta.content)
                for index, piece in [(0, PIECES[0]), (1, PIECES[0]), (0, PIECES[1])]]
    assert streamed == [(0, "The sea Hel"), (1, "The sea Hel"), (0, "lo")]


def test_the_stop_string_or_stop_token_that_ended_a_choice_is_its_stop_reason():
    """vLLM's ``stop_reason``: the orchestrator's, on the choice of a whole body and on its last chunk."""
    for stop_reason in ("four", 151643):
        last = dataclasses.replace(PIECES[-1], finish_reason="stop", stop_reason=stop_reason)
        for shape in (ChatShape("tiny", return_token_ids=False), CompletionShape("tiny", return_token_ids=False)):
            assert sent(shape.whole([_reply([*PIECES[:-1], last])]))["choices"][0]["stop_reason"] == stop_reason
            assert sent(shape.chunk(0, last))["choices"][0]["stop_reason"] == stop_reason
    for shape in (ChatShape("tiny", return_token_ids=False), CompletionShape("tiny", return_token_ids=False)):
        assert sent(shape.whole([_reply(PIECES)]))["choices"][0]["stop_reason"] is None  # "length"


def test_the_timeline_comes_on_the_last_chunk_and_the_whole_completion():
    for shape in (ChatShape("tiny", return_token_ids=False), CompletionShape("tiny", return_token_ids=False)):
        chunks = [sent(shape.chunk(0, piece)) for piece in PIECES]
        assert chunks[-1]["timeline"] == TIMELINE and all("timeline" not in c for c in chunks[:-1])
    reply = Reply()
    for piece in PIECES:
        reply.add(piece)
    assert sent(CompletionShape("tiny", return_token_ids=False).whole([reply]))["timeline"] == TIMELINE


def _reply(pieces) -> Reply:
    reply = Reply()
    for piece in pieces:
        reply.add(piece)
    return reply


def _last(text: bytes, prompt: int, output: int, cached: int | None = None) -> ResponsePiece:
    return ResponsePiece(text, (), num_input_tokens=prompt, num_output_tokens=output, num_cached_tokens=cached,
                         finish_reason="stop", final=True)


def test_several_choices_count_each_prompt_once_and_every_choices_output():
    """Two prompts, two choices each (choice k is prompt k // 2's): prompt tokens once a prompt, from its first
    choice (the others found it in the prefix cache), completion tokens of all four, as vLLM counts them."""
    replies = [_reply([_last(b"a", 10, 3, 0)]), _reply([_last(b"b", 10, 4, 8)]),
               _reply([_last(b"c", 20, 5, 16)]), _reply([_last(b"d", 20, 6, 16)])]
    body = sent(CompletionShape("tiny", return_token_ids=False, n=2).whole(replies))
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "a"), (1, "b"), (2, "c"), (3, "d")]
    assert body["usage"] == {"prompt_tokens": 30, "completion_tokens": 18, "total_tokens": 48,
                             "prompt_tokens_details": {"cached_tokens": 16}}


def test_streamed_choices_each_start_with_the_role_and_the_extras_are_choice_0s():
    shape = ChatShape("tiny", return_token_ids=False, n=2)
    first = ResponsePiece(b"x", (), visual_cap=CAP, media=MEDIA)
    chunks = [sent(shape.chunk(index, piece))
              for index, piece in [(0, first), (1, first), (1, _last(b"y", 7, 2)), (0, _last(b"z", 7, 3, 0))]]
    assert [(c["choices"][0]["index"], c["choices"][0]["delta"].get("role")) for c in chunks] == [
        (0, "assistant"), (1, "assistant"), (1, None), (0, None)]
    assert "visual_cap" in chunks[0] and all("visual_cap" not in c and "media" not in c for c in chunks[1:])
    assert shape.streamed_usage().model_dump() == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12,
                                                   "prompt_tokens_details": {"cached_tokens": 0}}


def test_echo_puts_each_prompt_before_its_choices_text():
    shape = CompletionShape("tiny", return_token_ids=False, n=2, echo=["Once", "Twice"])
    replies = [_reply([_last(b" upon", 1, 1)]) for _ in range(4)]
    assert [c.text for c in shape.whole(replies).choices] == ["Once upon", "Once upon", "Twice upon", "Twice upon"]
    streamed = [shape.chunk(index, piece).choices[0].text
                for index, piece in [(2, ResponsePiece(b" a")), (2, ResponsePiece(b" b")), (0, ResponsePiece(b""))]]
    assert streamed == ["Twice a", " b", "Once"]


ENTRY = {"7": {"logprob": -0.5, "rank": 1, "decoded_token": "b"}}
FIRST = {"5": {"logprob": None, "rank": None, "decoded_token": "a"}}


def test_a_prompts_other_choices_copy_its_first_choices_prompt_log_probabilities():
    """Only a prompt's first choice asks for them (choices.sample_requests); the others show the same, whole and
    streamed, with echo's logprobs starting with them."""
    first = ResponsePiece(b"c", (9,), prompt_logprobs=[FIRST, ENTRY], logprobs=[ENTRY], num_input_tokens=2,
                          num_output_tokens=1, finish_reason="length", final=True)
    other = dataclasses.replace(first, prompt_logprobs=None)
    shape = CompletionShape("tiny", return_token_ids=False, top_logprobs=1, n=2, echo=["ab"])
    for choice in shape.whole([_reply([first]), _reply([other])]).choices:
        assert choice.prompt_logprobs == [None, ENTRY] and choice.text == "abc"
        assert choice.logprobs.tokens == ["a", "b", "b"] and choice.logprobs.token_logprobs == [None, -0.5, -0.5]
    shape = CompletionShape("tiny", return_token_ids=False, top_logprobs=1, n=2, echo=["ab"])
    streamed = [shape.chunk(0, first).choices[0], shape.chunk(1, other).choices[0]]
    assert [c.logprobs.token_logprobs for c in streamed] == [[None, -0.5, -0.5]] * 2


def test_echo_with_max_tokens_0_is_the_prompt_alone_and_token_id_prompts_echo_their_text():
    """vLLM's echo without generation: the orchestrator's one token is not shown (text, ids, logprobs); a token-id
    prompt's echo is the text its first response brings (``prompt_text``)."""
    piece = ResponsePiece(b"c", (9,), prompt_logprobs=[FIRST, ENTRY], logprobs=[ENTRY], prompt_text="ab",
                          num_input_tokens=2, num_output_tokens=1, finish_reason="length", final=True)
    shape = CompletionShape("tiny", return_token_ids=True, top_logprobs=1, echo=[[5, 7]], echo_only=True)
    (choice,) = shape.whole([_reply([piece])]).choices
    assert (choice.text, choice.token_ids, choice.logprobs.tokens) == ("ab", [], ["a", "b"])
    shape = CompletionShape("tiny", return_token_ids=True, top_logprobs=1, echo=[[5, 7]], echo_only=True)
    (chunk,) = shape.chunk(0, piece).choices
    assert (chunk.text, chunk.token_ids, chunk.logprobs.token_logprobs) == ("ab", [], [None, -0.5])
    shape = CompletionShape("tiny", return_token_ids=True, top_logprobs=1, echo=[[5, 7]])
    assert shape.whole([_reply([piece])]).choices[0].text == "abc"


def test_return_token_ids_puts_the_prompts_ids_on_the_reply_and_the_first_chunk_as_vllm_does():
    """vLLM's ``prompt_token_ids`` with ``return_token_ids``: a chat's on the reply and on choice 0's first chunk; a
    completion's on each choice (streamed: its first chunk), a prompt's other choices taking its first choice's (only
    that one asks: ``choices.sample_requests``); left out without ``return_token_ids``."""
    first = [dataclasses.replace(PIECES[0], input_ids=(9, 8, 7)), *PIECES[1:]]
    reply = Reply()
    for piece in first:
        reply.add(piece)
    assert reply.prompt_ids == (9, 8, 7)
    assert sent(ChatShape("tiny", return_token_ids=True).whole([reply]))["prompt_token_ids"] == [9, 8, 7]
    assert "prompt_token_ids" not in sent(ChatShape("tiny", return_token_ids=False).whole([reply]))
    chunks = [sent(ChatShape("tiny", return_token_ids=True).chunk(0, piece)) for piece in first]
    assert chunks[0]["prompt_token_ids"] == [9, 8, 7] and all("prompt_token_ids" not in c for c in chunks[1:])
    other = Reply()
    for piece in PIECES:  # choice 1 of the same prompt: no ids of its own
        other.add(piece)
    body = sent(CompletionShape("tiny", return_token_ids=True, n=2).whole([reply, other]))
    assert [c["prompt_token_ids"] for c in body["choices"]] == [[9, 8, 7], [9, 8, 7]]
    shape = CompletionShape("tiny", return_token_ids=True, n=2)
    streamed = [sent(shape.chunk(index, piece)) for index, piece in ((0, first[0]), (1, PIECES[0]), (0, first[1]))]
    assert [c["choices"][0].get("prompt_token_ids") for c in streamed] == [[9, 8, 7], [9, 8, 7], None]
