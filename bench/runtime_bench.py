"""GPU runtime benchmark (issues 4, 22): a preset's language model (dummy bf16 weights) on one GPU.

    python3 bench/runtime_bench.py --out DIR [--preset qwen2_5_vl_7b]

``--preset`` (default ``qwen2_5_vl_7b``; also ``internvl3_38b``, ``internvl3_8b``, the tiny ones): the model is
``load_model(ModelSpec(preset=...))`` in bfloat16; every family keeps its language model at
``model.model.language_model`` and ``model.lm_head`` (``backends/runtime/families/base.py``), and prompts get the
family's ``prompt_positions`` (Qwen2.5-VL's three M-RoPE rows, InternVL3's one 1-D row), as encode_prefill does.
The 38B's KV is 256 KiB a token (1 GiB a sequence at 4k): beside its 77 GB of weights one H200 holds batch 32
(``bench/device_run.sh internvl-bench``: ``--batches 1 8 32``).

* decode step (forward + sampling, the tokens read back) at batch 1, 8, 32, 64, 128, 256 with 4,096 tokens
  of context each, for flashinfer with CUDA graphs (with and without the decoder layers compiled by
  ``torch.compile``, as the decode stage runs them by default; ``--skip-compiled`` leaves that out),
  flashinfer eager, and the torch reference backend (small batches only: it gathers the KV;
  ``--skip-torch-backend``), against the memory floor: the bytes a step must read (all
  language-model weights but the input-embedding table, of which only the batch's rows are read, plus
  the LM head and every sequence's KV) / 4.3 TB/s (:class:`Sizes`);
* prefill of one chunk of 512 .. 8,192 tokens on an empty cache: tokens/s and MFU against 790 TFLOP/s,
  FLOPs = 2 x (non-embedding, non-LM-head parameters) per token + causal attention
  (2 x 2 x layers x heads x head_dim x n(n+1)/2) + the LM head for the last token;
* the naive baseline in the same run: transformers' ``generate()`` (SDPA) on the same weights: batch 1
  with a 1,024-token prompt (time to the first token, then per token) and batch 32 (time per step);
  ours on the same shapes (1,024-token prefill + first token; decode step at batch 32 and 1,024 tokens).
  ``--skip-baseline`` leaves ``generate()`` out (it loads the model a second time).

Prompts are random token ids below 150,000 (or the vocabulary size), visual pad ids excepted.

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
from typing import Sequence

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
from bench.common import (DEFAULT_PRESET, H200_BF16_FLOPS, H200_HBM_BYTES_PER_S, add_preset_argument,  # noqa: E402
                          bar_chart, cuda_time_ms, header, write)

DEVICE = torch.device("cuda", 0)
PAGE = 16
GREEDY = SamplingParams(temperature=0)


def spec(preset: str) -> ModelSpec:
    return ModelSpec(preset=preset, dtype="bfloat16", device=str(DEVICE))


class Sizes:
    """Byte and FLOP counts of a model's language model (see the module docstring), from its parameters (any
    device, ``meta`` included) and its text config: ``model.model.language_model`` and ``model.lm_head`` in every
    family. Bytes are the parameters' own element size (2 in bfloat16); the KV pool is in the same dtype."""

    def __init__(self, model) -> None:
        lm = model.model.language_model
        text = model.config.get_text_config()
        embed, head = lm.embed_tokens.weight, model.lm_head.weight
        self.element_bytes = embed.element_size()
        self.embed_bytes = embed.numel() * self.element_bytes
        lm_bytes = sum(p.numel() * p.element_size() for p in lm.parameters())
        self.head_params = head.numel()
        self.read_bytes = lm_bytes - self.embed_bytes + head.numel() * head.element_size()
        self.body_params = sum(p.numel() for p in lm.parameters()) - embed.numel()
        self.hidden = text.hidden_size
        self.layers = text.num_hidden_layers
        self.heads = text.num_attention_heads
        self.head_dim = head_dim(model.config)
        self.kv_token_bytes = 2 * self.layers * text.num_key_value_heads * self.head_dim * self.element_bytes
        self.id_bound = min(150000, text.vocab_size)  # prompts' ids are drawn below this
        # ids the family's prompt_positions reads as visual pad tokens: none in a text prompt
        self.pad_ids = [getattr(model.config, name) for name in ("image_token_id", "video_token_id")
                        if getattr(model.config, name, None) is not None]

    def decode_floor_ms(self, batch: int, context: int) -> float:
        """Milliseconds to read a decode step's bytes at 4.3 TB/s: the weights of :attr:`read_bytes`, the batch's
        embedding rows and ``batch * context`` tokens of KV."""
        bytes_read = (self.read_bytes + batch * self.hidden * self.element_bytes
                      + batch * context * self.kv_token_bytes)
        return bytes_read / H200_HBM_BYTES_PER_S * 1e3

    def prefill_flops(self, n: int) -> float:
        """FLOPs of an ``n``-token chunk on an empty cache (the module docstring's formula)."""
        attention = 2 * 2 * self.layers * self.heads * self.head_dim * n * (n + 1) / 2
        return 2 * self.body_params * n + attention + 2 * self.head_params

    def random_ids(self, *shape: int, device: torch.device = DEVICE) -> torch.Tensor:
        """int64 token ids of ``shape`` on ``device`` below :attr:`id_bound`, a visual pad id (:attr:`pad_ids`)
        replaced by 0."""
        ids = torch.randint(0, self.id_bound, shape, device=device)
        for pad in self.pad_ids:
            ids.masked_fill_(ids == pad, 0)
        return ids


def start(name: str, preset: str = DEFAULT_PRESET) -> tuple[dict, torch.nn.Module, Sizes]:
    """The run's header, ``preset`` on the GPU and its sizes; exits, naming the bench ``name``, without a GPU."""
    if not torch.cuda.is_available():
        sys.exit(f"{name} needs a CUDA GPU")
    results = header(DEVICE, ("flashinfer",))
    model, _ = load_model(spec(preset))
    return results, model, Sizes(model)


def prompt_chunk(runner: ModelRunner, ids: torch.Tensor, block_table: Sequence[int]) -> PrefillChunk:
    """A whole text prompt of ``ids`` (int64 ``[n]``) as one chunk on an empty cache, its logits wanted; positions
    from the family's ``prompt_positions`` (``[position_rows, n]``), as encode_prefill builds them."""
    positions, _ = runner.family.prompt_positions(runner.model.config, ids.tolist())
    return PrefillChunk(runner.embed(ids), positions.to(runner.device), 0, block_table, want_logits=True)


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


def bench_decode(model, sizes: Sizes, batches: list[int], context: int, repeats: int, compiled: bool = True,
                 torch_backend: bool = True) -> list[dict]:
    """Decode rows per batch (module docstring); ``compiled``: also with the decoder layers compiled (then left
    compiled in ``model``); ``torch_backend``: also the torch backend at batches up to 8."""
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
    if compiled:
        bench_compiled(model, runner, rows, batches, context, per_seq, repeats)
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    if torch_backend:
        ref = make_runner(model, "torch", 8 * per_seq)
        for row in rows:
            if row["batch"] <= 8:
                seqs = decode_batch(row["batch"], context, per_seq)
                row["torch_backend_ms"] = cuda_time_ms(lambda: decode_step(ref, seqs), max(3, repeats // 4))
        del ref
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def bench_compiled(model, runner: ModelRunner, rows: list[dict], batches: list[int], context: int, per_seq: int,
                   repeats: int) -> None:
    """The same graphs with the decoder layers' small ops fused by torch.compile
    (backends/runtime/language_model/compile.py): planned at the step, planned ahead and overlapped, into ``rows``."""
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


def bench_prefill(model, sizes: Sizes, chunks: list[int], repeats: int) -> list[dict]:
    runner = make_runner(model, "flashinfer", pages_needed(max(chunks), PAGE))
    rows = []
    for n in chunks:
        chunk = prompt_chunk(runner, sizes.random_ids(n), list(range(pages_needed(n, PAGE))))
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


def bench_generate_baseline(preset: str, sizes: Sizes, prompt_len: int, new_tokens: int, batches: tuple[int, ...]
                            ) -> dict:
    """transformers' generate() (SDPA, its own DynamicCache) on the same weights (a fresh ``preset`` model, text
    prompts: any family's ``generate()`` takes ``input_ids`` alone): time to the first token (max_new_tokens=1) and
    per step after it."""
    model, _ = load_model(spec(preset))
    out = {}
    for batch in batches:
        ids = sizes.random_ids(batch, prompt_len)

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


def bench_ours_on_baseline_shapes(model, sizes: Sizes, prompt_len: int, batches: tuple[int, ...], repeats: int
                                  ) -> dict:
    per_seq = pages_needed(prompt_len + 1, PAGE)
    runner = make_runner(model, "flashinfer", max(batches) * per_seq)
    runner.enable_cuda_graphs(batch_ladder(max(batches)))
    out = {}
    for batch in batches:
        seqs = decode_batch(batch, prompt_len, per_seq)
        chunk = prompt_chunk(runner, sizes.random_ids(prompt_len), seqs[0].block_table)
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
    context = results["decode"][0]["context"] if results["decode"] else 0
    bar_chart(f"{results['model']['preset']} LM, bf16, {context} context, {results['device']} ({results['date']})",
              rows, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``argv``, default ``sys.argv[1:]``); exits with a usage error for a batch, chunk, context or
    repeat count below 1."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for runtime_bench.json / .png")
    add_preset_argument(parser)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--chunks", type=int, nargs="*", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--skip-baseline", action="store_true", help="leave out transformers' generate()")
    parser.add_argument("--skip-compiled", action="store_true",
                        help="leave out the decode steps with torch.compile'd decoder layers")
    parser.add_argument("--skip-torch-backend", action="store_true",
                        help="leave out the torch reference attention backend's decode steps")
    args = parser.parse_args(argv)
    if min([*args.batches, *args.chunks, args.context, args.repeats], default=1) < 1:
        parser.error("--batches, --chunks, --context and --repeats must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    results, model, sizes = start("runtime_bench", args.preset)
    results["model"] = {"preset": args.preset, "dtype": "bfloat16", "weights_read_per_step_bytes": sizes.read_bytes,
                        "kv_bytes_per_token": sizes.kv_token_bytes, "hbm_bytes_per_s": H200_HBM_BYTES_PER_S,
                        "peak_bf16_flops": H200_BF16_FLOPS}
    out = Path(args.out)
    results["prefill"] = bench_prefill(model, sizes, args.chunks, max(5, args.repeats // 2))
    write(out, "runtime_bench", results)  # and after each part: a later failure keeps what ran
    results["decode"] = bench_decode(model, sizes, args.batches, args.context, args.repeats,
                                     compiled=not args.skip_compiled, torch_backend=not args.skip_torch_backend)
    write(out, "runtime_bench", results)
    results["ours_on_baseline_shapes"] = bench_ours_on_baseline_shapes(model, sizes, 1024, (1, 32), args.repeats)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    if not args.skip_baseline:
        results["generate_baseline"] = bench_generate_baseline(args.preset, sizes, 1024, 16, (1, 32))
        for b, base in results["generate_baseline"].items():
            ours = results["ours_on_baseline_shapes"][b]
            print(f"b={b}: output tokens/s {ours['tokens_per_s'] / base['tokens_per_s']:.1f}x generate(), "
                  f"first token {base['ttft_ms'] / ours['ttft_ms']:.1f}x faster")
    write(out, "runtime_bench", results)
    plot(results, out / "runtime_bench.png")


if __name__ == "__main__":
    main()
