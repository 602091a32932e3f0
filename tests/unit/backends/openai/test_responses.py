"""The orchestrator's responses -> OpenAI's bodies (backends/openai/responses.py): text, token ids, usage, what
max_visual_tokens lowered, what was done with each media item and the request's timeline, whole and streamed."""
from backends.openai.responses import ChatShape, CompletionShape, Reply
from client.api import ResponsePiece

CAP = {"max_visual_tokens": 400, "requested_visual_tokens": 1152, "visual_tokens": 384, "fps": 0.6,
       "max_pixels": [None]}
TIMELINE = {"events": [{"ms": 0.4, "event": "parsed"}, {"ms": 9.5, "event": "first_token"}]}
MEDIA = [{"kind": "video", "grid_thw": [1, 20, 28], "visual_tokens": 140, "frames_in_file": 1, "duration_s": 0.1,
          "frames": 1, "sampled_frames": 2, "fps": 20.0}]
PIECES = [ResponsePiece(b"Hel", (1, 2), visual_cap=CAP, media=MEDIA), ResponsePiece(b"lo", (3,)),
          ResponsePiece(b"", (), num_input_tokens=500, num_output_tokens=3, num_cached_tokens=480,
                        finish_reason="length", final=True, timeline=TIMELINE)]


def test_a_whole_chat_reply_carries_text_ids_usage_the_visual_cap_and_media():
    reply = Reply()
    for piece in PIECES:
        reply.add(piece)
    body = ChatShape("tiny", return_token_ids=True).whole(reply).model_dump()
    assert body["choices"][0]["message"]["content"] == "Hello" and body["choices"][0]["token_ids"] == [1, 2, 3]
    assert body["usage"] == {"prompt_tokens": 500, "completion_tokens": 3, "total_tokens": 503,
                             "prompt_tokens_details": {"cached_tokens": 480}}  # OpenAI's field, as vLLM fills it
    assert body["visual_cap"] == CAP and body["media"] == MEDIA and body["timeline"] == TIMELINE


def test_the_first_streamed_chunk_carries_the_visual_cap_and_media_and_the_others_do_not():
    shape = ChatShape("tiny", return_token_ids=False)
    chunks = [shape.chunk(piece).model_dump(exclude_none=True) for piece in PIECES]
    assert chunks[0]["visual_cap"] == CAP and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[0]["media"] == MEDIA
    assert all("visual_cap" not in c and "media" not in c for c in chunks[1:])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_the_timeline_comes_on_the_last_chunk_and_the_whole_completion():
    for shape in (ChatShape("tiny", return_token_ids=False), CompletionShape("tiny", return_token_ids=False)):
        chunks = [shape.chunk(piece).model_dump(exclude_none=True) for piece in PIECES]
        assert chunks[-1]["timeline"] == TIMELINE and all("timeline" not in c for c in chunks[:-1])
    reply = Reply()
    for piece in PIECES:
        reply.add(piece)
    assert CompletionShape("tiny", return_token_ids=False).whole(reply).model_dump()["timeline"] == TIMELINE
