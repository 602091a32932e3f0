"""The orchestrator's ``logprobs`` entries as OpenAI's objects (``backends.openai.logprobs``): chat's per-token
text, log probability, bytes and top tokens by rank; completions' tokens, text offsets running on from where the
chunk's text starts, and top tokens by text."""
from backends.openai.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs

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


def test_completion_offsets_run_on_from_the_chunks_start_and_top_tokens_are_keyed_by_text():
    whole = completion_logprobs([OUTSIDE, INSIDE], 0, 2)
    assert (whole.tokens, whole.token_logprobs, whole.text_offset) == (["é", "b"], [-2.0, -1.0], [0, 1])
    assert whole.top_logprobs == [{"é": -2.0, " a": -0.5, "b": -1.0}, {"b": -1.0, " a": -0.5}]
    assert completion_logprobs([INSIDE], 7, 2).text_offset == [7]  # a streamed chunk after 7 characters of text
    assert completion_logprobs([OUTSIDE], 0, 1).top_logprobs == [{"é": -2.0, " a": -0.5}]  # the top 1 and itself


# an echoed prompt's first token: its text, no log probability (it follows nothing)
FIRST = {"7": {"logprob": None, "rank": None, "decoded_token": "Hi"}}


def test_an_echoed_prompts_first_token_has_its_text_and_null_figures_as_vllm_gives_them():
    echoed = completion_logprobs([FIRST, INSIDE], 0, 1)
    assert (echoed.tokens, echoed.token_logprobs, echoed.text_offset) == (["Hi", "b"], [None, -1.0], [0, 2])
    assert echoed.top_logprobs == [None, {"b": -1.0, " a": -0.5}]
    assert prompt_logprobs([FIRST, INSIDE]) == [None, INSIDE]
    assert prompt_logprobs(None) is None
