"""Several choices of one OpenAI request (``n``, a completion's list of prompts, ``echo``) through the API process
and a real tritonserver: each choice is the single request it stands for (sample i with seed + i), a prompt's other
choices find its pages in the prefix cache, and the usage counts each prompt once."""
from __future__ import annotations

import base64

import pytest

from tests.e2e.conftest import settled, wait_for_idle_pools
from tests.e2e.test_openai_api import MODEL, N, api, sdk  # noqa: F401 - the module's API process and SDK client
from tests.e2e.test_prefix_cache import counters
from tests.media import make_image

pytestmark = pytest.mark.e2e
PAGE = 16  # decode's kv_page_size (model_repository/decode/config.pbtxt)
SAMPLED = {"max_tokens": N, "temperature": 1.0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


def _chat_choices(sdk, n: int, stream: bool, seed: int, content) -> tuple[list[list[int]], object]:
    """Each choice's token ids (by index) and the usage of one chat request."""
    reply = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], n=n, seed=seed,
                                        stream=stream, **SAMPLED,
                                        **({"stream_options": {"include_usage": True}} if stream else {}))
    if not stream:
        assert [c.index for c in reply.choices] == list(range(n))
        return [c.token_ids for c in reply.choices], reply.usage
    ids: list[list[int]] = [[] for _ in range(n)]
    roles, reasons, usage = [0] * n, [None] * n, None
    for chunk in reply:
        if chunk.usage is not None:
            usage = chunk.usage
            continue
        (choice,) = chunk.choices
        assert reasons[choice.index] is None, "a chunk after its choice's finish_reason"
        roles[choice.index] += choice.delta.role == "assistant"
        ids[choice.index] += choice.token_ids
        reasons[choice.index] = choice.finish_reason
    assert roles == [1] * n and reasons == ["length"] * n  # each choice: its role once, its end once
    return ids, usage


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n_sampled_choices_are_the_single_requests_with_seed_plus_their_index(sdk, stream):
    question = f"Name three rivers ({'streamed' if stream else 'whole'})."
    ids, usage = _chat_choices(sdk, 3, stream, 41, question)
    singles = [_chat_choices(sdk, 1, stream, 41 + i, question) for i in range(3)]
    assert ids == [single[0][0] for single in singles]
    assert len({tuple(choice) for choice in ids}) > 1  # sampled with three seeds: not all the same
    assert usage.prompt_tokens == singles[0][1].prompt_tokens and usage.completion_tokens == 3 * N
    assert usage.total_tokens == usage.prompt_tokens + 3 * N


def test_a_prompts_other_choices_share_its_pages_through_the_prefix_cache(sdk, server):
    """An image prompt no other test sends, n=3: the second and third choices are sent after the first's first token
    and find all its full pages short of the last token cached, so the prefix cache's hits grow by at least twice
    that; greedy, the three choices are the same."""
    image = make_image(104, 72, "RGB", "PNG")
    content = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{base64.b64encode(image).decode()}"}},
               {"type": "text", "text": "Which shapes are in it, and where?"}]
    before = settled(lambda: counters(server))
    reply = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], n=3,
                                        max_tokens=N, temperature=0, extra_body={"return_token_ids": True})
    after = settled(lambda: counters(server))
    shared = (reply.usage.prompt_tokens - 1) // PAGE * PAGE
    assert after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"] >= 2 * shared > 0
    assert reply.choices[0].token_ids == reply.choices[1].token_ids == reply.choices[2].token_ids
    m = wait_for_idle_pools(server, timeout_s=30)
    assert m["unifiedserve_num_requests_running"] == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_completions_prompts_and_echo(sdk, stream):
    """Two prompts, two greedy choices each, echoed: choice k is prompt k // 2's, its text that prompt followed by
    the single request's completion; the usage counts each prompt once and every choice's tokens."""
    prompts = ["The river flows", "Mountains rise"]
    greedy = {"max_tokens": N, "temperature": 0, "extra_body": {"ignore_eos": True}}
    singles = [sdk.completions.create(model=MODEL, prompt=p, **greedy) for p in prompts]
    reply = sdk.completions.create(model=MODEL, prompt=prompts, n=2, echo=True, stream=stream, **greedy,
                                   **({"stream_options": {"include_usage": True}} if stream else {}))
    texts = [""] * 4
    if stream:
        usage = None
        for chunk in reply:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
            usage = chunk.usage or usage
    else:
        texts, usage = [c.text for c in reply.choices], reply.usage
    expected = [prompts[k // 2] + singles[k // 2].choices[0].text for k in range(4)]
    assert texts == expected
    assert usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles) and usage.completion_tokens == 4 * N


def test_continuous_usage_stats_give_every_chunk_its_choices_usage_so_far(sdk):
    """vLLM's ``stream_options.continuous_usage_stats``: each chunk's usage is its prompt's tokens and its choice's
    tokens so far (the ids it has brought), every chunk's with its prompt's cached tokens as its last has them; the
    usage-only chunk at the end still counts them all (the cached tokens: choice 0's)."""
    stream = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to ten."}], n=2,
                                         seed=3, stream=True, **SAMPLED,
                                         stream_options={"include_usage": True, "continuous_usage_stats": True})
    made, prompt, last, cached = [0, 0], set(), None, [set(), set()]
    for chunk in stream:
        if not chunk.choices:
            last = chunk.usage
            continue
        (choice,) = chunk.choices
        made[choice.index] += len(choice.token_ids)
        cached[choice.index].add(chunk.usage.prompt_tokens_details.cached_tokens)
        assert chunk.usage.completion_tokens == made[choice.index]
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + made[choice.index]
        prompt.add(chunk.usage.prompt_tokens)
    assert made == [N, N] and len(prompt) == 1
    assert (last.prompt_tokens, last.completion_tokens) == (prompt.pop(), 2 * N)
    assert [len(each) for each in cached] == [1, 1] and cached[0] == {last.prompt_tokens_details.cached_tokens}
