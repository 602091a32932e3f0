"""The sampler on CUDA: the same tokens as on the CPU for the same (seed, step, logits), and no device->host
sync before the tokens are read.

Run on the device: `python3 -m pytest -q -m gpu tests/gpu/test_runtime_sampler_cuda.py` (skipped without CUDA).
"""
import pytest
import torch

from backends.runtime.sampling.sampler import (SamplingParams, _cuda_race, _exponentials, _lowbias32, _race, _token_hash,
                                      _top_p_mask, _top_p_threshold, sample, sample_tensor, warm_up)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
VOCAB = 151_936  # Qwen2.5-VL's
EOS = [151_643, 151_645]


def _batch(rows: int) -> tuple[torch.Tensor, list[SamplingParams], list[int]]:
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    params = [SamplingParams(temperature=[0, 0.7, 1.0, 1.3][i % 4], top_k=[0, 50, 1, 0, 200][i % 5],
                             top_p=[1.0, 0.9, 0.5][i % 3], min_p=[0.0, 0.0, 0.01, 0.2, 0.0, 0.5, 1.0][i % 7],
                             seed=i, min_tokens=i % 2) for i in range(rows)]
    return logits, params, [i % 3 for i in range(rows)]


def test_cuda_tokens_equal_cpu_tokens():
    logits, params, steps = _batch(256)
    cpu = sample(logits, params, steps, EOS)
    cuda = sample(logits.cuda(), params, steps, EOS)
    # The hash is exact integer arithmetic (see the test below); the tokens could differ only where two
    # float scores tie within an ulp, which these logits do not produce.
    assert cuda == cpu


def test_cuda_hash_equals_cpu_hash():
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 1 << 32, (1 << 20,), generator=gen)
    assert torch.equal(_lowbias32(x.cuda()).cpu(), _lowbias32(x.clone()))  # exact integer arithmetic
    keys = torch.randint(0, 1 << 32, (16,), generator=gen)
    # U is exact in float32 on both; only log may round differently.
    e_cuda = _exponentials(keys.cuda(), _token_hash(VOCAB, torch.device("cuda"))).cpu()
    torch.testing.assert_close(e_cuda, _exponentials(keys, _token_hash(VOCAB, torch.device("cpu"))), rtol=3e-7, atol=0)


@pytest.mark.parametrize("scale", [3.0, 8.0, 20.0])
def test_flashinfer_top_p_keeps_what_the_sort_keeps(scale):
    pytest.importorskip("flashinfer")  # without it, CUDA sorts too and this would compare the sort with itself
    rows = 256
    scores = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(2)).cuda() * scale
    top_p = torch.tensor([[0.5, 0.9, 0.95, float("inf")][i % 4] for i in range(rows)]).cuda()
    temperature = torch.ones(rows, 1, device="cuda")
    kept = _top_p_mask(scores.clone(), top_p, temperature) > float("-inf")
    by_sort = scores >= _top_p_threshold(scores, scores.sort(dim=-1, descending=True).values, top_p, temperature)
    assert kept[3::4].all()  # top-p off
    # The same sets, but for the last token where the running sum meets top_p within float rounding.
    differing = (kept != by_sort).sum(dim=-1)
    assert differing.max() <= 1 and (differing > 0).sum() <= rows // 16, differing.nonzero().tolist()


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_compiled_race_equals_eager_race(rows):
    gen = torch.Generator().manual_seed(rows)
    scores = (torch.randn(rows, VOCAB, generator=gen) * 3).cuda()
    scores[:, ::7] = float("-inf")  # filtered tokens
    keys = torch.randint(0, 1 << 32, (rows,), generator=gen).cuda()
    token_hash = _token_hash(VOCAB, scores.device)
    compiled = _cuda_race(scores.device, VOCAB)
    assert compiled is not _race  # compiled here, not fallen back
    with torch.no_grad():
        assert torch.equal(compiled(scores, keys, token_hash), _race(scores, keys, token_hash))


def test_a_seeded_row_draws_the_same_token_in_any_batch_on_cuda():
    gen = torch.Generator().manual_seed(4)
    row = torch.randn(1, VOCAB, generator=gen) * 3
    target = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=11)
    for step in range(20):
        alone = sample(row.cuda(), [target], [step], EOS)[0]
        for size in (2, 7, 8, 33):  # with other rows, some with top-p alone (the flashinfer path)
            others = torch.randn(size - 1, VOCAB, generator=gen) * 3
            params = [SamplingParams(temperature=1.0, top_p=0.95)] * (size - 1) + [target]
            batch = torch.cat([others, row]).cuda()
            assert sample(batch, params, [0] * (size - 1) + [step], EOS)[-1] == alone, (step, size)


def test_no_sync_before_the_tokens_are_read():
    logits, params, steps = _batch(64)
    logits = logits.cuda()
    warm_up(logits.device, VOCAB)  # compiles the race
    sample_tensor(logits, params, steps, EOS)  # warm the caches (token hash, pinned memory)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = sample_tensor(logits, params, steps, EOS)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.device.type == "cuda" and tokens.dtype == torch.int64
    assert tokens.tolist() == sample(logits.cpu(), params, steps, EOS)


def test_warm_up_leaves_nothing_to_compile():
    warm_up(torch.device("cuda"), VOCAB)
    gen = torch.Generator().manual_seed(5)
    torch._dynamo.config.error_on_recompile = True
    try:
        for rows in (1, 2, 64):  # one drawn row (keys of one element), the dynamic size, a large batch
            logits = (torch.randn(rows, VOCAB, generator=gen) * 3).cuda()
            for params in (SamplingParams(temperature=0.7), SamplingParams(top_k=20, top_p=0.9, seed=1),
                           SamplingParams(top_p=0.9)):
                sample(logits, [params] * rows, [3] * rows, EOS)
    finally:
        torch._dynamo.config.error_on_recompile = False


def test_rows_without_a_finite_logit_do_not_fail_on_cuda():
    logits = (torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(6)) * 3)
    logits[0] = float("nan")
    logits[1] = float("-inf")
    logits[1, EOS] = 1.0  # only eos finite, and min_tokens masks it
    params = [SamplingParams(top_p=0.9, seed=1), SamplingParams(top_p=0.9, min_tokens=2, seed=2),
              SamplingParams(top_p=0.9, top_k=5, seed=3)]
    tokens = sample(logits.cuda(), params, [0, 0, 0], EOS)  # flashinfer's top-p on the first two rows
    torch.cuda.synchronize()  # no device-side assert
    assert len(tokens) == 3 and all(0 <= t < VOCAB for t in tokens)


def test_cuda_log_probabilities_ride_to_the_host_with_the_tokens_and_equal_the_cpus():
    """``logprobs`` on CUDA through ``TokenReadback``'s pinned copies: the same figures as on the CPU (float32
    log-softmax; ranks and top ids exact), rows that did not ask None; in a batch where only some rows ask, picking
    them waits for nothing on the device (a CUDA sync there would undo decode's overlapped steps)."""
    from backends.runtime.sampling import logprobs
    from backends.runtime.sampling.token_readback import TokenReadback

    logits, params, steps = _batch(8)
    params = [SamplingParams(temperature=0, logprobs=[None, 0, 5][i % 3]) for i in range(8)]

    def figures_on(device: str):
        on_device = logits.to(device)
        tokens = sample_tensor(on_device, params, steps, EOS)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")  # a sync in start or finish raises
        try:
            asked, table = logprobs.start(on_device, params)
            figures = logprobs.finish(asked, table, tokens)
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        readback = TokenReadback(tokens, figures)
        return readback.tolist(), logprobs.rows(asked, readback.figures(), params)

    (cpu_tokens, cpu), (cuda_tokens, cuda) = figures_on("cpu"), figures_on("cuda")
    assert cuda_tokens == cpu_tokens and [f is None for f in cuda] == [p.logprobs is None for p in params]
    for ours, theirs in zip(cuda, cpu):
        if ours is not None:
            assert ours.rank == theirs.rank == 1 and [t for t, _ in ours.top] == [t for t, _ in theirs.top]
            assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-4)


def test_cuda_logit_bias_equals_the_cpus_without_a_sync():
    """``logit_bias`` on CUDA, bfloat16 logits as decode's: the CPU's values, and neither the one-off function nor
    decode's cache (first step and a cached one) waits for anything on the device."""
    from backends.runtime.sampling.logit_bias import LogitBias, apply_logit_bias

    logits, _, _ = _batch(4)
    params = [SamplingParams(logit_bias=((5, 100.0), (VOCAB - 1, -3.5))), SamplingParams(),
              SamplingParams(logit_bias=((0, -100.0),)), SamplingParams()]
    on_device, cache = logits.bfloat16().cuda(), LogitBias()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        biased = [apply_logit_bias(on_device, params), cache.apply(on_device, params), cache.apply(on_device, params)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = apply_logit_bias(logits.bfloat16(), params)
    assert all(torch.equal(b.cpu(), expected) for b in biased)


def test_cuda_grammar_masks_equal_the_cpus_without_a_sync():
    """A structured output's mask (backends/runtime/sampling/grammar.py) on CUDA, float32 logits as the stages':
    the CPU's -inf where the matcher forbids a token and the logits elsewhere, rows without a matcher untouched,
    and nothing waits for the device (the bitmask goes over pinned; xgrammar's kernel is built at start)."""
    from backends.ipc.protocol import StructuredOutput
    from backends.runtime.loader import ModelSpec, load_model
    from backends.runtime.sampling.grammar import Grammars
    from backends.runtime.tokenizer import eos_token_ids

    _, tokenizer = load_model(ModelSpec())
    grammars = Grammars(tokenizer, VOCAB, eos_token_ids(tokenizer), torch.device("cuda"))
    logits, _, _ = _batch(3)
    matchers = [grammars.matcher(StructuredOutput("regex", "[ab]+c")), None,
                grammars.matcher(StructuredOutput("json_object"))]
    expected = grammars.mask(logits.clone(), matchers)
    on_device = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grammars.mask(on_device, matchers)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(on_device.cpu(), expected) and torch.equal(expected[1], logits[1])
    assert int((expected[0] > -torch.inf).sum()) == 2  # "a" and "b"


def _built_kernels(kernel) -> int:
    """How many variants of a Triton kernel are built in this process (Triton 3's per-device caches)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return sum(len(cache[0]) for cache in caches.values())
    return sum(len(cache) for cache in kernel.cache.values())


def test_the_grammar_mask_kernel_is_built_at_start_for_any_number_of_rows():
    """xgrammar's mask kernel is a Triton kernel, built per specialization of the rows (1, a multiple of 16, any
    other): each is built when the stage starts, so a step of any size builds none (a build stalls its step)."""
    from xgrammar.kernels.apply_token_bitmask_inplace_triton import apply_token_bitmask_inplace_kernel

    from backends.ipc.protocol import StructuredOutput
    from backends.runtime.loader import ModelSpec, load_model
    from backends.runtime.sampling.grammar import Grammars
    from backends.runtime.tokenizer import eos_token_ids

    _, tokenizer = load_model(ModelSpec())
    grammars = Grammars(tokenizer, VOCAB, eos_token_ids(tokenizer), torch.device("cuda"))
    built = _built_kernels(apply_token_bitmask_inplace_kernel)
    for rows in (1, 3, 16, 17, 32, 64):
        matchers = [grammars.matcher(StructuredOutput("regex", "[ab]+c"))] * rows
        grammars.mask(torch.zeros(rows, VOCAB, device="cuda"), matchers)
    torch.cuda.synchronize()
    assert _built_kernels(apply_token_bitmask_inplace_kernel) == built


def test_cuda_prompt_log_probabilities_equal_the_cpus_without_a_sync():
    """``prompt_logprobs``' figures (``logprobs.prompt_figures``) of a prefill chunk on CUDA, a few rows at a time:
    the CPU's (float32 head and hidden states, so that ranks among 151,936 logits compare: in bfloat16 a random
    token's rank moves by hundreds with one rounding step), and nothing waits for the device (the next ids go over
    pinned memory)."""
    from backends.runtime.sampling.logprobs import prompt_figures

    generator = torch.Generator().manual_seed(3)
    head = torch.nn.Linear(64, VOCAB, bias=False)
    torch.nn.init.normal_(head.weight, std=0.5, generator=generator)
    hidden = torch.randn(300, 64, generator=generator)
    next_ids = torch.randint(0, VOCAB, (299,), generator=generator)
    with torch.inference_mode():
        expected = prompt_figures(head, hidden, next_ids, 3, rows_at_once=128)
        head, on_device = head.cuda(), hidden.cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            figures = prompt_figures(head, on_device, next_ids, 3, rows_at_once=128)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    figures = figures.cpu()
    assert figures.shape == (299, 8)
    torch.testing.assert_close(figures[:, [0, 5, 6, 7]], expected[:, [0, 5, 6, 7]], rtol=1e-4, atol=1e-4)
    assert (figures[:, 1] - expected[:, 1]).abs().max() <= 2  # ranks, up to float32 near-ties
    assert torch.equal(figures[:, 2:5], expected[:, 2:5])  # the top ids
