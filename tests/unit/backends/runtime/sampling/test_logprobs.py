"""Log probabilities of sampled tokens (``backends.runtime.sampling.logprobs``): the log-softmax of the raw logits,
the sampled token's rank counted as vLLM v1 counts it, the top tokens most likely first; rows that do not ask get
None, and a batch where none asks computes nothing; the figures ride to the host with the tokens
(``TokenReadback``)."""
import pytest
import torch

from backends.ipc.protocol import SamplingParams, TokenLogprobs
from backends.runtime.sampling import logprobs
from backends.runtime.sampling.token_readback import TokenReadback


def figures_of(logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]) -> list[TokenLogprobs | None]:
    asking = logprobs.start(logits, params)
    sampled = torch.tensor(tokens)
    readback = TokenReadback(sampled, logprobs.finish(*asking, sampled) if asking else None)
    return logprobs.rows(asking[0] if asking else None, readback.figures(), params)


def test_each_asking_row_gets_its_tokens_log_softmax_rank_and_top_tokens():
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    params = [SamplingParams(logprobs=2), SamplingParams(), SamplingParams(logprobs=0)]
    tokens = [int(logits[0].argsort(descending=True)[3]), 7, int(logits[2].argmax())]
    first, skipped, last = figures_of(logits, params, tokens)
    reference = torch.log_softmax(logits, dim=-1)
    assert skipped is None
    assert first.logprob == pytest.approx(float(reference[0, tokens[0]]), abs=1e-6) and first.rank == 4
    top = reference[0].topk(2)
    assert [t for t, _ in first.top] == top.indices.tolist()
    assert [v for _, v in first.top] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert last.rank == 1 and last.top == () and last.logprob == pytest.approx(float(reference[2].max()), abs=1e-6)


def test_a_rank_counts_every_token_at_least_as_likely_as_vllm_does():
    """vLLM v1 (``batched_count_greater_than``): the tokens whose log probability is >= the sampled one's, so a
    token tied with the most likely is ranked 2 as well as it."""
    logits = torch.tensor([[2.0, 2.0, 1.0, 0.0]])
    (tied,) = figures_of(logits, [SamplingParams(logprobs=1)], [1])
    assert tied.rank == 2 and tied.top[0][0] in (0, 1)


def test_rows_of_a_batch_where_none_asks_are_none_and_nothing_is_computed():
    params = [SamplingParams(), SamplingParams(temperature=0)]
    assert logprobs.start(torch.zeros(2, 8), params) is None
    assert figures_of(torch.zeros(2, 8), params, [0, 1]) == [None, None]


def test_the_log_probabilities_are_the_raw_logits_whatever_the_sampling_settings():
    """Temperature, top-k and penalties change which token is drawn, not the figures (vLLM's ``raw_logprobs``)."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    hot = SamplingParams(temperature=5.0, top_k=2, repetition_penalty=1.5, logprobs=1)
    (figures,) = figures_of(logits, [hot], [2])
    assert figures.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[0, 2]), abs=1e-6)
    assert figures.rank == 2 and figures.top[0][0] == 3


@pytest.mark.parametrize("value", [-1, 21])
def test_a_logprobs_count_out_of_range_is_refused(value):
    with pytest.raises(ValueError, match=r"logprobs must be in \[0, 20\]"):
        SamplingParams(logprobs=value)
