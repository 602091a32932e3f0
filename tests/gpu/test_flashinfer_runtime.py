"""flashinfer attention and CUDA-graph decode against the torch reference backend, on the GPU.

* the kernels on random paged layouts (shuffled pages, ragged chunks on cached prefixes, decode rows), each
  prefill step on the kernel ``prefill_kernel`` picks (FA2 for a short chunk over a long context);
* ``tiny`` and ``internvl3_tiny`` in bf16: the whole runner with flashinfer against the runner with torch attention
  (logits within 1e-2 relative error, greedy tokens equal except genuine ties);
* CUDA graphs (both families): replayed decode equals eager decode, padding rows touch only the scratch page; steps
  planned ahead (while the previous one runs) equal steps planned when they run;
* ``qwen2_5_vl_7b`` in bf16: the first step's logits of a video+text prompt against transformers' own
  forward on the same weights and inputs (relative error 1e-2; argmax equal unless a near tie).

Run on the device: `python3 -m pytest -q tests/gpu/test_flashinfer_runtime.py` (skipped without CUDA or
flashinfer).
"""
from __future__ import annotations

import random

import pytest
import torch

from backends.runtime.attention import (AttentionMetadata, FlashInferAttentionBackend, TorchAttentionBackend,
                                        make_backend)
from backends.runtime.language_model.cuda_graphs import batch_ladder
from backends.runtime.language_model.kv_cache import KVCacheLayout, pages_needed, scratch_page
from backends.runtime.loader import ModelSpec, load_model
from backends.runtime.model_runner import DecodeSeq, ModelRunner, PrefillChunk
from backends.runtime.language_model.mrope import mrope_positions
from tests.reference import reference_generate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DEVICE = torch.device("cuda:0")
RTOL = 1e-2  # the bound for bf16 kernels against the reference


@pytest.fixture(scope="module", autouse=True)
def _flashinfer():
    pytest.importorskip("flashinfer")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float32."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("sms_limit", [None, 100])  # 100: FA3 in row groups (sm_partition), as on a green context
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(28, 4, 128), (2, 1, 64)])
def test_kernels_match_torch_on_random_paged_layouts(heads, kv_heads, head_dim, sms_limit):
    rng = random.Random(0)
    torch.manual_seed(0)
    page_size, num_pages, layers = 16, 512, 2
    cache = torch.randn(layers, 2, num_pages, page_size, kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    fi = FlashInferAttentionBackend(heads, kv_heads, head_dim, page_size, torch.bfloat16, DEVICE)
    fi.sms_limit = sms_limit
    ref = TorchAttentionBackend()
    pages = list(range(num_pages))
    rng.shuffle(pages)
    for new, cached in [([1] * 7, [0, 5, 16, 33, 100, 255, 700]),        # decode rows
                        ([37, 1, 300, 16], [0, 90, 17, 512]),             # ragged chunks on cached prefixes
                        ([16], [3000]),                                   # short over long: FA2, split KV
                        ([1000], [0])]:                                   # one long first chunk
        tables, at = [], 0
        for n, c in zip(new, cached):
            k = pages_needed(n + c, page_size)
            tables.append(pages[at:at + k])
            at += k
        meta = AttentionMetadata.build(new, cached, tables, page_size, DEVICE)
        total = sum(new)
        q = torch.randn(total, heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
        k = torch.randn(total, kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
        v = torch.randn(total, kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
        outs = []
        for backend in (ref, fi):
            pool = cache.clone()
            backend.plan(meta)
            outs.append(backend.forward(1, q, k, v, pool))
            if backend is fi:  # both wrote the same new keys/values
                assert torch.equal(pool, expected_pool)
            expected_pool = pool
        assert rel_err(outs[1], outs[0]) < RTOL, (new, cached)
    if sms_limit is not None and heads == 28:  # 168 and 224 FA3 work items over 100 SMs: a step ran in row groups
        assert fi._row_group_wrappers


def test_fa3_in_row_groups_equals_one_call():
    """A step limited to fewer SMs than the device has (encode_prefill's green context) runs FA3 in row groups
    (backends/runtime/attention/sm_partition.py): a 2,048-token chunk over 3,000 cached tokens (448 work items of the
    7B's 28 heads, in six groups of at most 84 for 100 SMs) gives the one call's output exactly (each tile is
    computed alike)."""
    torch.manual_seed(0)
    heads, kv_heads, head_dim, page_size, new, cached = 28, 4, 128, 16, 2048, 3000
    pages = pages_needed(new + cached, page_size)
    cache = torch.randn(1, 2, pages, page_size, kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    meta = AttentionMetadata.build([new], [cached], [list(range(pages))], page_size, DEVICE)
    q = torch.randn(new, heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    k, v = (torch.randn(new, kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    outs = []
    for sms_limit in (None, 100):
        backend = FlashInferAttentionBackend(heads, kv_heads, head_dim, page_size, torch.bfloat16, DEVICE)
        backend.sms_limit = sms_limit
        backend.plan(meta)
        outs.append(backend.forward(0, q, k, v, cache.clone()))
    assert len(backend._row_group_wrappers) == 5  # six groups: the backend's FA3 wrapper and five more
    assert torch.equal(outs[0], outs[1])


def paged_runner(preset: str, backend: str, dtype: torch.dtype = torch.bfloat16, pages: int = 257,
            page_size: int = 16) -> ModelRunner:
    """The preset's float32 dummy weights cast to ``dtype``: every dtype holds the same values, so the float32
    torch runner is the exact reference of the bf16 ones."""
    model, _ = load_model(ModelSpec(preset=preset, dtype="float32", device=str(DEVICE)))
    model = model.to(dtype)
    layout = KVCacheLayout.from_config(model.config, num_pages=pages, page_size=page_size, dtype=dtype)
    pool = torch.zeros(layout.shape, dtype=layout.dtype, device=DEVICE)
    return ModelRunner(model, pool, page_size, make_backend(backend, model.config, page_size, dtype, DEVICE))


def _greedy(runner: ModelRunner, prompts: list[list[int]], steps: int,
            prepare: bool = False) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill all prompts as one ragged batch (in 2 chunks each), then decode them together. ``prepare``: plan
    each next step while the GPU runs this one, as the decode worker does (``ModelRunner.prepare_decode``), but
    at step 4 for a layout the next step does not have (one sequence fewer: another graph) and at step 7 for one
    of the same size (each sequence a token further), which those steps must not use."""
    tables, at = [], 0
    for ids in prompts:
        k = pages_needed(len(ids) + steps, runner.page_size)
        tables.append(list(range(at, at + k)))
        at += k
    half = [len(ids) // 2 for ids in prompts]
    all_logits = []
    for part in (0, 1):
        chunks = []
        for ids, h, table in zip(prompts, half, tables):
            start, end = (0, h) if part == 0 else (h, len(ids))
            embeds = runner.embed(torch.tensor(ids[start:end], device=DEVICE))
            positions = torch.arange(start, end, device=DEVICE).expand(runner.family.position_rows, -1)
            chunks.append(PrefillChunk(embeds, positions, start, table, want_logits=part == 1))
        logits = runner.prefill(chunks)
    tokens = [[int(t)] for t in logits.argmax(-1)]
    all_logits.append(logits)
    for step in range(1, steps):
        seqs = [DecodeSeq(out[-1], len(ids) + step - 1, len(ids) + step - 1, table)
                for ids, out, table in zip(prompts, tokens, tables)]
        logits = runner.decode(seqs)
        if prepare:
            ahead = [DecodeSeq(0, 0, s.num_cached + 1, s.block_table) for s in seqs]
            if step == 7:
                ahead = [DecodeSeq(0, 0, s.num_cached + 1, s.block_table) for s in ahead]
            runner.prepare_decode(ahead[:-1] if step == 4 else ahead)
        all_logits.append(logits)
        for out, t in zip(tokens, logits.argmax(-1).tolist()):
            out.append(t)
    return tokens, all_logits


def _assert_tokens_equal_or_tie(ours, ref, ref_logits, gap: float) -> None:
    for row, (a, b) in enumerate(zip(ours, ref)):
        for step, (x, y) in enumerate(zip(a, b)):
            if x != y:
                top2 = ref_logits[step][row].float().topk(2).values
                assert float(top2[0] - top2[1]) <= gap, f"row {row} step {step}: {x} != {y}, not a tie"
                break


@pytest.mark.parametrize("preset", ["tiny", "internvl3_tiny"])
def test_tiny_bf16_flashinfer_matches_torch_backend(preset):
    """The issue's bar: logits within 1e-2 of the torch backend in bf16. Both bf16 runs are also measured
    against the float32 run on the same weights: flashinfer must be no further from it than torch in bf16
    (the bf16 noise floor of this 2-layer model with large random weights is about 1e-2 itself)."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (5, 40, 130, 17)]
    fp32_tokens, fp32_logits = _greedy(paged_runner(preset, "torch", torch.float32), prompts, 12)
    ref_tokens, ref_logits = _greedy(paged_runner(preset, "torch"), prompts, 12)
    fi_tokens, fi_logits = _greedy(paged_runner(preset, "flashinfer"), prompts, 12)
    report = []
    for step in range(12):
        if any(a[step] != b[step] or a[step] != c[step] for a, b, c in zip(fi_tokens, ref_tokens, fp32_tokens)):
            break  # the sequences differ from here on: their logits are no longer comparable
        report.append((rel_err(fi_logits[step], ref_logits[step]), rel_err(fi_logits[step], fp32_logits[step]),
                       rel_err(ref_logits[step], fp32_logits[step])))
    print("step: flashinfer vs torch bf16, flashinfer vs fp32, torch bf16 vs fp32:",
          [tuple(round(e, 5) for e in r) for r in report])
    assert report, "the runs disagree from the first token"
    for step, (between, fi_err, torch_err) in enumerate(report):
        assert between < RTOL or fi_err <= 1.25 * torch_err, (step, between, fi_err, torch_err)
    scale = float(ref_logits[0].abs().max())
    _assert_tokens_equal_or_tie(fi_tokens, ref_tokens, ref_logits, gap=2 * RTOL * scale)


@pytest.mark.parametrize("preset", ["tiny", "internvl3_tiny"])
def test_cuda_graph_decode_equals_eager_and_keeps_padding_in_the_scratch_page(preset):
    eager = paged_runner(preset, "flashinfer")
    graphs = paged_runner(preset, "flashinfer")
    graphs.enable_cuda_graphs(batch_ladder(8))
    assert graphs.graphs is not None and graphs.graphs.max_batch == 8
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (9, 33, 70)]  # 3 rows -> the 4-row graph
    scratch = scratch_page(graphs.kv_cache.shape[2])
    before = graphs.kv_cache[:, :, :scratch].clone()
    tokens_e, logits_e = _greedy(eager, prompts, 10)
    tokens_g, logits_g = _greedy(graphs, prompts, 10)
    assert tokens_g == tokens_e
    for a, b in zip(logits_g, logits_e):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    # The sequences' pages hold the same KV either way; no row wrote outside its pages or the scratch page.
    torch.testing.assert_close(graphs.kv_cache[:, :, :scratch], eager.kv_cache[:, :, :scratch], rtol=0, atol=0)
    assert not torch.equal(graphs.kv_cache[:, :, :scratch], before)


def test_steps_planned_ahead_equal_steps_planned_when_they_run():
    """``prepare_decode`` during a step (the plan's copies queued behind the running graph, from pinned memory)
    gives bit-identical logits and KV to planning each step when it runs; a prepared plan for another layout is
    dropped, not replayed."""
    plain, ahead = paged_runner("tiny", "flashinfer"), paged_runner("tiny", "flashinfer")
    for runner in (plain, ahead):
        runner.enable_cuda_graphs(batch_ladder(8))
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (20, 47, 66, 90, 5)]  # 5 rows -> the 8-row graph
    tokens_p, logits_p = _greedy(plain, prompts, 10)
    tokens_a, logits_a = _greedy(ahead, prompts, 10, prepare=True)
    assert tokens_a == tokens_p
    assert all(torch.equal(a, b) for a, b in zip(logits_a, logits_p))
    assert torch.equal(ahead.kv_cache, plain.kv_cache)


def test_cuda_graph_runs_larger_batches_eagerly():
    runner = paged_runner("tiny", "flashinfer")
    runner.enable_cuda_graphs((1, 2))
    seqs = [DecodeSeq(5, 0, 0, [i]) for i in range(3)]
    assert runner.decode(seqs).shape[0] == 3  # above the ladder: eager path


def test_qwen2_5_vl_7b_first_step_logits_match_transformers():
    """The published 7B architecture (dummy weights): our bf16 runner (flashinfer attention, our vision
    attention, group-wise encoding, paged prefill) against transformers' forward on the same weights and
    inputs, in float32 (the exact reference) and in bf16 (the library's own bf16 error, for scale)."""
    model, tokenizer = load_model(ModelSpec(preset="qwen2_5_vl_7b", dtype="float32", device=str(DEVICE)))
    config = model.config
    grid = (2, 16, 28)  # 4 frames of 224x392: 2 temporal-patch groups, 224 visual tokens
    content = [{"type": "video"}, {"type": "text", "text": "What happens in this clip?"}]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)["input_ids"]
    at = ids.index(config.video_token_id)
    ids = ids[:at] + [config.video_token_id] * (grid[0] * grid[1] * grid[2] // 4) + ids[at + 1:]
    torch.manual_seed(0)
    pixels = torch.randn(grid[0] * grid[1] * grid[2], 1176, device=DEVICE)
    video = (pixels, grid, 1.0)
    _, (ref32,) = reference_generate(model, ids, 1, video=video)  # float32 [vocab]
    model = model.to(torch.bfloat16)
    _, (ref16,) = reference_generate(model, ids, 1, video=video)

    layout = KVCacheLayout.from_config(config, num_pages=64, page_size=16, dtype=torch.bfloat16)
    runner = ModelRunner(model, torch.zeros(layout.shape, dtype=layout.dtype, device=DEVICE), 16,
                         make_backend("flashinfer", config, 16, model.dtype, DEVICE))
    embeds = runner.embed(torch.tensor(ids, device=DEVICE))
    rows = grid[1] * grid[2]
    visual = torch.cat([runner.encode(pixels[g * rows:(g + 1) * rows], (1, grid[1], grid[2])) for g in range(grid[0])])
    embeds[torch.tensor(ids, device=DEVICE) == config.video_token_id] = visual
    positions, _ = mrope_positions(config, ids, video_grid_thw=[grid], second_per_grid_ts=[1.0])
    ours = runner.prefill([PrefillChunk(embeds, positions.to(DEVICE), 0, list(range(pages_needed(len(ids), 16))),
                                        want_logits=True)])[0]
    err, lib_err, between = rel_err(ours, ref32), rel_err(ref16, ref32), rel_err(ours, ref16)
    print(f"7B first-step logits: ours bf16 vs fp32 {err:.4f}, transformers bf16 vs fp32 {lib_err:.4f}, "
          f"ours vs transformers bf16 {between:.4f}")
    assert err < RTOL or err <= 1.25 * lib_err, (err, lib_err, between)
    top2 = ref32.topk(2)
    if float(top2.values[0] - top2.values[1]) > 2 * err * float(ref32.abs().max()):
        assert int(ours.argmax()) == int(top2.indices[0])
