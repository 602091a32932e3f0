"""Prompt log probabilities (``SamplingParams.prompt_logprobs``) from chunked prefill equal the log-softmax of
transformers' forward over the whole prompt, token by token, across chunk boundaries and beside other chunks."""
from __future__ import annotations

import pytest
import torch

from backends.runtime.attention import TorchAttentionBackend
from backends.runtime.language_model.kv_cache import KVCacheLayout
from backends.runtime.loader import ModelSpec, load_model
from backends.runtime.model_runner import ModelRunner, PrefillChunk
from backends.runtime.sampling.logprobs import prompt_figures

PAGE_SIZE = 4
TOP = 3


@pytest.fixture(scope="module")
def model():
    return load_model(ModelSpec())[0]  # the runner's weights (the same spec), untouched by it


@pytest.fixture(scope="module")
def runner():
    model, _ = load_model(ModelSpec())
    layout = KVCacheLayout.from_config(model.config, num_pages=64, page_size=PAGE_SIZE)
    return ModelRunner(model, torch.zeros(layout.shape, dtype=layout.dtype), PAGE_SIZE, TorchAttentionBackend())


def reference(model, ids: torch.Tensor) -> torch.Tensor:
    """log-softmax float32 ``[L - 1, V]`` of transformers' logits at each prompt position but the last."""
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def chunked(runner, ids: torch.Tensor, chunk: int, table: list[int], beside: torch.Tensor | None = None
            ) -> torch.Tensor:
    """The prompt's figures as the stage makes them: ``chunk`` tokens a step, each step's chunk with ``next_ids``,
    run beside a chunk of ``beside``'s tokens (another sequence, no log probabilities) where given."""
    parts = []
    for start in range(0, len(ids), chunk):
        end = min(start + chunk, len(ids))
        ours = PrefillChunk(runner.embed(ids[start:end]), torch.arange(start, end).expand(3, -1), start, table,
                            end == len(ids), next_ids=ids[start + 1:end + 1], top=TOP)
        steps = [ours]
        if beside is not None:
            steps.insert(0, PrefillChunk(runner.embed(beside), torch.arange(len(beside)).expand(3, -1), 0,
                                         [40, 41, 42, 43], True))
        _, scores = runner.prefill_scored(steps)
        assert scores[:-1] == [None] * (len(steps) - 1)  # the other sequence asked for none
        parts.append(scores[-1])
    return torch.cat(parts)


@pytest.mark.parametrize("chunk,beside", [(5, False), (64, False), (7, True)])
def test_prompt_figures_equal_the_log_softmax_of_the_whole_prompts_forward(model, runner, chunk, beside):
    torch.manual_seed(4)
    ids = torch.randint(0, 256, (23,))
    other = torch.randint(0, 256, (9,)) if beside else None
    figures = chunked(runner, ids, chunk, list(range(8)), other)
    expected = reference(model, ids)
    assert figures.shape == (22, 2 + 2 * TOP)
    taken = expected.gather(1, ids[1:, None])[:, 0]
    torch.testing.assert_close(figures[:, 0], taken, rtol=1e-4, atol=1e-4)
    assert figures[:, 1].tolist() == (expected >= taken[:, None]).sum(-1).float().tolist()
    top = expected.topk(TOP, dim=-1)
    assert figures[:, 2:2 + TOP].long().tolist() == top.indices.tolist()
    torch.testing.assert_close(figures[:, 2 + TOP:], top.values, rtol=1e-4, atol=1e-4)


def test_two_asking_chunks_in_one_step_get_each_its_own_figures(runner):
    """Two sequences' chunks, both asking (one a middle chunk: a figure per position), in one ragged step: each
    gets what it gets alone."""
    torch.manual_seed(5)
    a, b = torch.randint(0, 256, (12,)), torch.randint(0, 256, (7,))

    def chunk(ids, end, table):
        return PrefillChunk(runner.embed(ids[:end]), torch.arange(end).expand(3, -1), 0, table, end == len(ids),
                            next_ids=ids[1:end + 1], top=TOP)

    together = runner.prefill_scored([chunk(a, 9, [10, 11, 12]), chunk(b, 7, [20, 21])])[1]
    alone = [runner.prefill_scored([chunk(a, 9, [30, 31, 32])])[1][0],
             runner.prefill_scored([chunk(b, 7, [40, 41])])[1][0]]
    assert [f.shape[0] for f in together] == [9, 6]
    for ours, theirs in zip(together, alone):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_figures_made_a_few_rows_at_a_time_equal_those_made_at_once(runner):
    hidden = torch.randn(11, runner.model.config.text_config.hidden_size)
    next_ids = torch.randint(0, 256, (10,))
    at_once = prompt_figures(runner.model.lm_head, hidden, next_ids, 2, rows_at_once=64)
    torch.testing.assert_close(prompt_figures(runner.model.lm_head, hidden, next_ids, 2, rows_at_once=3), at_once)
    assert prompt_figures(runner.model.lm_head, hidden, next_ids[:0], 2).shape == (0, 6)


def test_more_next_ids_than_positions_are_refused(runner):
    chunk = PrefillChunk(runner.embed(torch.arange(3)), torch.arange(3).expand(3, -1), 0, [0], True,
                         next_ids=torch.arange(4), top=0)
    with pytest.raises(ValueError, match="4 next ids for a chunk of 3 tokens"):
        runner.prefill_scored([chunk])
    with pytest.raises(ValueError, match="run it with prefill_scored"):
        runner.prefill([chunk])
