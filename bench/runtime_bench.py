"""GPU runtime benchmark (issue 4): Qwen2.5-VL-7B's language model (dummy bf16 weights) on one GPU.

    python3 bench/runtime_bench.py --out DIR

* decode step (forward + sampling, the tokens read back) at batch 1, 8, 32, 64, 128, 256 with 4,096 tokens
  of context each, for flashinfer with CUDA graphs (with and without the decoder layers compiled by
  ``torch.compile``), flashinfer eager, and the torch reference backend
  (small batches only: it gathers the KV), against the memory floor: the bytes a step must read (all
  language-model weights but the input-embedding table, of which only the batch's rows are read, plus
  every sequence's KV) / 4.3 TB/s;
* prefill of one chunk of 512 .. 8,192 tokens on an empty cache: tokens/s and MFU against 790 TFLOP/s,
  FLOPs = 2 x (non-embedding, non-LM-head parameters) per token + causal attention
  (2 x 2 x layers x heads x head_dim x n(n+1)/2) + the LM head for the last token;
* the naive baseline in the same run: transformers' ``generate()`` (SDPA) on the same weights: batch 1
  with a 1,024-token prompt (time to the first token, then per token) and batch 32 (time per step);
  ours on the same shapes (1,024-token prefill + first token; decode step at batch 32 and 1,024 tokens).

Decode steps are timed as one step each, from the host's layout to the tokens read back, and (compiled layers)
also with the next step's layout planned while the GPU runs this one (``_ahead``: ``ModelRunner.prepare_decode``)
and as the decode stage runs them (``_overlap``: each step launched with the last one's tokens still on the
device, read only then; time per step over runs of 10); ours on the baseline's shapes is timed overlapped.
Writes ``<out>/runtime_bench.json`` and ``runtime_bench.png``.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from backends.runtime.attention import make_backend  # noqa: E402
from backends.runtime.language_model.cuda_graphs import batch_ladder  # noqa: E402
from backends.runtime.language_model.kv_cache import KVCacheLayout, head_dim, pages_needed  # noqa: E402
from backends.runtime.language_model.compile import compile_decoder_layers  # noqa: E402
from backends.runtime.loader import ModelSpec, load_model  # noqa: E402
from backends.runtime.model_runner import DecodeSeq, ModelRunner, PrefillChunk  # noqa: E402
from backends.runtime.sampling.sampler import SamplingParams, sample, sample_tensor  # noqa: E402
from backends.runtime.sampling.token_readback import TokenReadback  # noqa: E402
from bench.common import H200_BF16_FLOPS, H200_HBM_BYTES_PER_S, bar_chart, cuda_time_ms, header, write  # noqa: E402

DEVICE = torch.device("cuda", 0)
PAGE = 16
GREEDY = SamplingParams(temperature=0)


def spec() -> ModelSpec:
    return ModelSpec(preset="qwen2_5_vl_7b", dtype="bfloat16", device=str(DEVICE))


class Sizes:
    """Byte and FLOP counts of the model (see the module docstring)."""

    def __init__(self, model) -> None:
        lm = model.model.language_model
        text = model.config.text_config
        self.embed_bytes = lm.embed_tokens.weight.numel() * lm.embed_tokens.weight.element_size()
        lm_bytes = sum(p.numel() * p.element_size() for p in lm.parameters())
        head = model.lm_head.weight
        self.head_params = head.numel()
        self.read_bytes = lm_bytes - self.embed_bytes + head.numel() * head.element_size()
        self.body_params = sum(p.numel() for p in lm.parameters()) - lm.embed_tokens.weight.numel()
        self.hidden = text.hidden_size
        self.layers = text.num_hidden_layers
        self.heads = text.num_attention_heads
        self.head_dim = head_dim(model.config)
        self.kv_token_bytes = 2 * self.layers * text.num_key_value_heads * self.head_dim * 2

    def decode_floor_ms(self, batch: int, context: int) -> float:
        bytes_read = self.read_bytes + batch * self.hidden * 2 + batch * context * self.kv_token_bytes
        return bytes_read / H200_HBM_BYTES_PER_S * 1e3

    def prefill_flops(self, n: int) -> float:
        attention = 2 * 2 * self.layers * self.heads * self.head_dim * n * (n + 1) / 2
        return 2 * self.body_params * n + attention + 2 * self.head_params


def start(name: str) -> tuple[dict, torch.nn.Module, Sizes]:
    """The run's header, the 7B preset on the GPU and its sizes; exits, naming the bench ``name``, without a GPU."""
    if not torch.cuda.is_available():
        sys.exit(f"{name} needs a CUDA GPU")
    results = header(DEVICE, ("flashinfer",))
    model, _ = load_model(spec())
    return results, model, Sizes(model)


def make_runner(model, backend: str, pages: int) -> ModelRunner:
    layout = KVCacheLayout.from_config(model.config, num_pages=pages + 1, page_size=PAGE, dtype=model.dtype)
    pool = torch.zeros(layout.shape, dtype=layout.dtype, device=DEVICE)
    return ModelRunner(model, pool, PAGE, make_backend(backend, model.config, PAGE, model.dtype, DEVICE))


def decode_step(runner: ModelRunner, seqs: list[DecodeSeq]) -> list[int]:
    logits = runner.decode(seqs)
    return sample(logits, [GREEDY] * len(seqs), [0] * len(seqs), [])


def decode_step_ahead(runner: ModelRunner, seqs: list[DecodeSeq]) -> list[int]:
    """A step as the decode stage runs it: the next step (here the same layout) is planned while the GPU runs
    this one, before the tokens are read."""
    tokens = sample_tensor(runner.decode(seqs), [GREEDY] * len(seqs), [0] * len(seqs), [])
    runner.prepare_decode(seqs)
    return tokens.tolist()


def decode_steps_overlapped(runner: ModelRunner, seqs: list[DecodeSeq], steps: int) -> None:
    """``steps`` steps as the decode stage runs them (``backends/stages/decode_worker.py``): each launched with
    the last one's tokens still on the device, that step's tokens read only then, and the next step planned
    while the GPU runs."""
    previous = None
    for _ in range(steps):
        logits = runner.decode(seqs, None if previous is None else previous.on_device)
        launched = TokenReadback(sample_tensor(logits, [GREEDY] * len(seqs), [0] * len(seqs), []))
        if previous is not None:
            previous.tolist()
        runner.prepare_decode(seqs)
        previous = launched
    previous.tolist()


def overlapped_ms(runner: ModelRunner, seqs: list[DecodeSeq], repeats: int, steps: int = 10) -> float:
    """Milliseconds per step of :func:`decode_steps_overlapped`, median over ``repeats`` runs of ``steps``."""
    return cuda_time_ms(lambda: decode_steps_overlapped(runner, seqs, steps), repeats) / steps


def decode_batch(batch: int, context: int, per_seq: int) -> list[DecodeSeq]:
    """``batch`` sequences of ``context`` cached tokens, sequence i in pages ``i*per_seq .. (i+1)*per_seq - 1``
    (int32 arrays, as the decode worker keeps block tables)."""
    return [DecodeSeq(7, context, context, np.arange(i * per_seq, (i + 1) * per_seq, dtype=np.int32))
            for i in range(batch)]


def bench_decode(model, sizes: Sizes, batches: list[int], context: int, repeats: int) -> list[dict]:
    rows = []
    per_seq = pages_needed(context + 1, PAGE)
    runner = make_runner(model, "flashinfer", max(batches) * per_seq)
    runner.enable_cuda_graphs(batch_ladder(max(batches)))
    for batch in batches:
        seqs = decode_batch(batch, context, per_seq)
        graphs = runner.graphs
        graph_ms = cuda_time_ms(lambda: decode_step(runner, seqs), repeats)
        runner.graphs = None
        eager_ms = cuda_time_ms(lambda: decode_step(runner, seqs), repeats)
        runner.graphs = graphs
        floor = sizes.decode_floor_ms(batch, context)
        row = {"batch": batch, "context": context, "floor_ms": floor, "flashinfer_graph_ms": graph_ms,
               "flashinfer_eager_ms": eager_ms, "graph_vs_floor": graph_ms / floor,
               "tokens_per_s": batch / graph_ms * 1e3}
        rows.append(row)
        print(f"decode b={batch:4d} ctx={context}: graph {graph_ms:7.2f} ms, eager {eager_ms:7.2f} ms, "
              f"floor {floor:6.2f} ms ({graph_ms / floor:.2f}x)", flush=True)
    # The same graphs with the decoder layers' small ops fused by torch.compile (backends/runtime/language_model/compile.py).
    start = time.perf_counter()
    compile_decoder_layers(model.model.language_model)
    runner.enable_cuda_graphs(batch_ladder(max(batches)))  # warm-up runs compile, then capture
    compile_s = time.perf_counter() - start
    for row in rows:
        seqs = decode_batch(row["batch"], context, per_seq)
        row["flashinfer_graph_compiled_ms"] = ms = cuda_time_ms(lambda: decode_step(runner, seqs), repeats)
        row["compiled_vs_floor"] = ms / row["floor_ms"]
        row["flashinfer_graph_compiled_ahead_ms"] = ahead = cuda_time_ms(lambda: decode_step_ahead(runner, seqs),
                                                                         repeats)
        row["compiled_ahead_vs_floor"] = ahead / row["floor_ms"]
        row["flashinfer_graph_compiled_overlap_ms"] = over = overlapped_ms(runner, seqs, max(3, repeats // 4))
        row["compiled_overlap_vs_floor"] = over / row["floor_ms"]
        print(f"decode b={row['batch']:4d} compiled layers + graph {ms:7.2f} ms ({ms / row['floor_ms']:.2f}x floor), "
              f"planned ahead {ahead:7.2f} ms ({ahead / row['floor_ms']:.2f}x floor), "
              f"overlapped {over:7.2f} ms ({over / row['floor_ms']:.2f}x floor)", flush=True)
    rows[0]["compile_and_capture_s"] = compile_s
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    ref = make_runner(model, "torch", 8 * per_seq)
    for row in rows:
        if row["batch"] <= 8:
            seqs = decode_batch(row["batch"], context, per_seq)
            row["torch_backend_ms"] = cuda_time_ms(lambda: decode_step(ref, seqs), max(3, repeats // 4))
    del ref
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def bench_prefill(model, sizes: Sizes, chunks: list[int], repeats: int) -> list[dict]:
    runner = make_runner(model, "flashinfer", pages_needed(max(chunks), PAGE))
    rows = []
    for n in chunks:
        embeds = runner.embed(torch.randint(0, 150000, (n,), device=DEVICE))
        chunk = PrefillChunk(embeds, torch.arange(n, device=DEVICE).expand(3, -1), 0,
                             list(range(pages_needed(n, PAGE))), want_logits=True)
        ms = cuda_time_ms(lambda: runner.prefill([chunk]), repeats)
        flops = sizes.prefill_flops(n)
        rows.append({"tokens": n, "ms": ms, "tokens_per_s": n / ms * 1e3, "tflops": flops / ms / 1e9,
                     "mfu": flops / (ms * 1e-3) / H200_BF16_FLOPS})
        print(f"prefill {n:5d} tokens: {ms:7.2f} ms, {n / ms * 1e3:9.0f} tok/s, MFU {rows[-1]['mfu']:.2f}",
              flush=True)
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def bench_generate_baseline(prompt_len: int, new_tokens: int, batches: tuple[int, ...]) -> dict:
    """transformers' generate() (SDPA, its own DynamicCache) on the same weights: time to the first token
    (max_new_tokens=1) and per step after it."""
    model, _ = load_model(spec())
    out = {}
    for batch in batches:
        ids = torch.randint(0, 150000, (batch, prompt_len), device=DEVICE)

        def run(n: int) -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                           min_new_tokens=n, eos_token_id=None)
            torch.cuda.synchronize()
            return (time.perf_counter() - start) * 1e3

        run(2)  # warm-up
        first = min(run(1) for _ in range(3))
        total = min(run(new_tokens) for _ in range(2))
        step = (total - first) / (new_tokens - 1)
        out[str(batch)] = {"prompt": prompt_len, "ttft_ms": first, "step_ms": step, "tokens_per_s": batch / step * 1e3}
        print(f"generate() b={batch}: first token {first:.1f} ms, {step:.2f} ms/step", flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def bench_ours_on_baseline_shapes(model, prompt_len: int, batches: tuple[int, ...], repeats: int) -> dict:
    per_seq = pages_needed(prompt_len + 1, PAGE)
    runner = make_runner(model, "flashinfer", max(batches) * per_seq)
    runner.enable_cuda_graphs(batch_ladder(max(batches)))
    out = {}
    for batch in batches:
        seqs = decode_batch(batch, prompt_len, per_seq)
        embeds = runner.embed(torch.randint(0, 150000, (prompt_len,), device=DEVICE))
        chunk = PrefillChunk(embeds, torch.arange(prompt_len, device=DEVICE).expand(3, -1), 0, seqs[0].block_table,
                             True)
        ttft = cuda_time_ms(lambda: sample(runner.prefill([chunk]), [GREEDY], [0], []), repeats)
        plain = cuda_time_ms(lambda: decode_step(runner, seqs), repeats)
        ahead = cuda_time_ms(lambda: decode_step_ahead(runner, seqs), repeats)
        step = overlapped_ms(runner, seqs, max(3, repeats // 4))
        out[str(batch)] = {"prompt": prompt_len, "ttft_ms": ttft, "step_ms": step, "step_planned_ahead_ms": ahead,
                           "step_planned_at_step_ms": plain, "tokens_per_s": batch / step * 1e3}
        print(f"ours b={batch}: first token {ttft:.1f} ms, {step:.2f} ms/step overlapped ({ahead:.2f} planned "
              f"ahead, {plain:.2f} planned at the step)", flush=True)
    return out


def plot(results: dict, path: Path) -> None:
    rows = []
    for r in results["decode"]:
        rows.append((f"decode b={r['batch']} floor", r["floor_ms"], f"{r['floor_ms']:.2f} ms"))
        rows.append((f"decode b={r['batch']} flashinfer+graphs", r["flashinfer_graph_ms"],
                     f"{r['flashinfer_graph_ms']:.2f} ms ({r['graph_vs_floor']:.2f}x floor)"))
        if "flashinfer_graph_compiled_ms" in r:
            rows.append((f"decode b={r['batch']} + compiled layers", r["flashinfer_graph_compiled_ms"],
                         f"{r['flashinfer_graph_compiled_ms']:.2f} ms ({r['compiled_vs_floor']:.2f}x floor)"))
            rows.append((f"decode b={r['batch']} + planned ahead", r["flashinfer_graph_compiled_ahead_ms"],
                         f"{r['flashinfer_graph_compiled_ahead_ms']:.2f} ms ({r['compiled_ahead_vs_floor']:.2f}x floor)"))
            rows.append((f"decode b={r['batch']} + overlapped", r["flashinfer_graph_compiled_overlap_ms"],
                         f"{r['flashinfer_graph_compiled_overlap_ms']:.2f} ms "
                         f"({r['compiled_overlap_vs_floor']:.2f}x floor)"))
    for b, base in results.get("generate_baseline", {}).items():
        ours = results["ours_on_baseline_shapes"][b]
        rows.append((f"step b={b} transformers generate()", base["step_ms"], f"{base['step_ms']:.1f} ms"))
        rows.append((f"step b={b} ours", ours["step_ms"],
                     f"{ours['step_ms']:.1f} ms ({base['step_ms'] / ours['step_ms']:.1f}x faster)"))
    bar_chart(f"Qwen2.5-VL-7B LM, bf16, 4k context, {results['device']} ({results['date']})", rows, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for runtime_bench.json / .png")
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--chunks", type=int, nargs="*", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--skip-baseline", action="store_true", help="leave out transformers' generate()")
    args = parser.parse_args()
    results, model, sizes = start("runtime_bench")
    results["model"] = {"preset": "qwen2_5_vl_7b", "dtype": "bfloat16", "weights_read_per_step_bytes": sizes.read_bytes,
                        "kv_bytes_per_token": sizes.kv_token_bytes, "hbm_bytes_per_s": H200_HBM_BYTES_PER_S,
                        "peak_bf16_flops": H200_BF16_FLOPS}
    results["prefill"] = bench_prefill(model, sizes, args.chunks, max(5, args.repeats // 2))
    results["decode"] = bench_decode(model, sizes, args.batches, args.context, args.repeats)
    results["ours_on_baseline_shapes"] = bench_ours_on_baseline_shapes(model, 1024, (1, 32), args.repeats)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    if not args.skip_baseline:
        results["generate_baseline"] = bench_generate_baseline(1024, 16, (1, 32))
        for b, base in results["generate_baseline"].items():
            ours = results["ours_on_baseline_shapes"][b]
            print(f"b={b}: output tokens/s {ours['tokens_per_s'] / base['tokens_per_s']:.1f}x generate(), "
                  f"first token {base['ttft_ms'] / ours['ttft_ms']:.1f}x faster")
    out = Path(args.out)
    write(out, "runtime_bench", results)
    plot(results, out / "runtime_bench.png")


if __name__ == "__main__":
    main()
