"""The orchestrator's ``logprobs`` entries as OpenAI's objects (``backends.openai.logprobs``): chat's per-token
text, log probability, bytes and top tokens by rank; completions' tokens, text offsets running on across a stream's
chunks, and top tokens by text; -inf sent as vLLM's floor."""
from backends.openai.logprobs import MIN_LOGPROB, chat_logprobs, completion_logprobs

# "é" sampled at rank 3; the top two are " a" and "b" (the sampled token is not among them)
OUTSIDE = {"10": {"logprob": -2.0, "rank": 3, "decoded_token": "é"},
           "11": {"logprob": -0.5, "rank": 1, "decoded_token": " a"},
           "12": {"logprob": -1.0, "rank": 2, "decoded_token": "b"}}
# "b" sampled, itself the second most likely: it is in the entry once, with its rank
INSIDE = {"12": {"logprob": -1.0, "rank": 2, "decoded_token": "b"},
          "11": {"logprob": -0.5, "rank": 1, "decoded_token": " a"}}


def test_a_chat_token_has_its_text_bytes_and_the_top_tokens_by_rank():
    first, second = chat_logprobs([OUTSIDE, INSIDE], top=2).content
    assert (first.token, first.logprob, first.bytes) == ("é", -2.0, [0xC3, 0xA9])
    assert [(t.token, t.logprob) for t in first.top_logprobs] == [(" a", -0.5), ("b", -1.0)]
    assert second.token == "b" and [t.token for t in second.top_logprobs] == [" a", "b"]
    assert chat_logprobs([OUTSIDE], top=0).content[0].top_logprobs == []


def test_completion_offsets_run_on_across_chunks_and_top_tokens_are_keyed_by_text():
    head, offset = completion_logprobs([OUTSIDE], 0)
    tail, end = completion_logprobs([INSIDE], offset)
    assert (head.tokens, head.token_logprobs, head.text_offset) == (["é"], [-2.0], [0])
    assert head.top_logprobs == [{"é": -2.0, " a": -0.5, "b": -1.0}]
    assert (tail.tokens, tail.text_offset, end) == (["b"], [1], 2)


def test_an_infinite_log_probability_is_sent_as_vllms_floor():
    entry = {"3": {"logprob": float("-inf"), "rank": 9, "decoded_token": "x"}}
    assert chat_logprobs([entry], top=1).content[0].logprob == MIN_LOGPROB
    assert completion_logprobs([entry], 0)[0].token_logprobs == [MIN_LOGPROB]
