"""OpenAI's and vLLM's ``logit_bias`` in the stages (``backends.runtime.sampling.logit_bias``): each row's biases added
to a float32 copy of its logits, nothing else changed; decode's :class:`LogitBias` keeps the upload while the batch
is the same, and makes it again when a row changes; the stage protocol refuses biases out of range or repeated."""
import pytest
import torch

from backends.ipc.protocol import SamplingParams
from backends.runtime.sampling import logit_bias
from backends.runtime.sampling.logit_bias import LogitBias, apply_logit_bias
from backends.runtime.sampling.sampler import sample

LOGITS = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])


def test_logit_bias_is_added_to_its_rows_tokens_only_and_leaves_the_logits_unchanged():
    """+100 makes a token the greedy choice, -100 takes one away; other rows and tokens as they were; the logits
    given are not written (bfloat16 ones too: the result is float32); a batch without a bias gets its own logits."""
    params = [SamplingParams(temperature=0, logit_bias=((0, 100.0), (3, -0.5))), SamplingParams(temperature=0)]
    biased = apply_logit_bias(LOGITS, params)
    assert biased.tolist() == [[100.0, 1.0, 2.0, 2.5], [3.0, 2.0, 1.0, 0.0]]
    assert LOGITS.tolist()[0] == [0.0, 1.0, 2.0, 3.0]
    assert sample(biased, params, [0, 0], []) == [0, 0]
    banned = [SamplingParams(temperature=0, logit_bias=((3, -100.0),))]
    assert sample(apply_logit_bias(LOGITS[:1], banned), banned, [0], []) == [2]
    assert apply_logit_bias(LOGITS.bfloat16(), params).dtype == torch.float32
    plain = [SamplingParams(temperature=0)] * 2
    assert apply_logit_bias(LOGITS, plain) is LOGITS


def test_decodes_cache_keeps_the_upload_while_the_batch_is_the_same_and_makes_it_again_when_a_row_changes(
        monkeypatch):
    packs = []
    original = logit_bias.packed_bias
    monkeypatch.setattr(logit_bias, "packed_bias", lambda params, device: packs.append(1) or original(params, device))
    cache, biased = LogitBias(), SamplingParams(logit_bias=((1, 5.0),))
    batch = [biased, SamplingParams()]
    for _ in range(3):
        assert torch.equal(cache.apply(LOGITS, batch), apply_logit_bias(LOGITS, batch))
    assert len(packs) == 1 + 3  # once for the cache, once for each apply_logit_bias above
    other = [SamplingParams(logit_bias=((2, -1.0),)), SamplingParams()]
    assert torch.equal(cache.apply(LOGITS, other), apply_logit_bias(LOGITS, other))
    assert cache.apply(LOGITS, [SamplingParams()] * 2) is LOGITS


@pytest.mark.parametrize("bias", [((5, 100.5),), ((-1, 1.0),), ((5, 1.0), (5, 2.0))])
def test_a_logit_bias_out_of_range_or_repeated_is_refused(bias):
    with pytest.raises(ValueError, match="logit_bias must map distinct ids >= 0 to biases in"):
        SamplingParams(logit_bias=bias)
