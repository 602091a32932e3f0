"""Short prefills as the encode_prefill stage runs them (issue 20: a text request's first token, a follow-up question).

    python3 bench/prefill_probe.py --out DIR [--tokens 16 64 117 256 512] [--contexts 0 14432 106960]
                                   [--passes eager graphs compiled]

Qwen2.5-VL-7B (dummy bf16 weights) on one GPU, flashinfer attention. One chunk of ``n`` new tokens over ``c`` tokens
already in the KV pool (a cached prefix: the chunk attends to all of them), its last token's logits wanted, for
each ``n`` of ``--tokens`` and ``c`` of ``--contexts``, in the passes of ``--passes``, in this order:

* ``eager``: the decoder layers launched op by op (encode_prefill without ``prefill_graphs``);
* ``graphs``: one sequence's chunk of up to 512 tokens replaying a captured CUDA graph of the smallest rung that holds
  it (``backends.runtime.language_model.prefill_graphs``, as encode_prefill's ``prefill_graphs`` runs it: eager
  layers, the plan and the input copies on the host per chunk, the LM head outside the graph); larger chunks run
  eagerly;
* ``compiled``: eager steps with the decoder layers compiled (``backends.runtime.language_model.compile``,
  ``dynamic=True``: one graph for all token counts, as the decode stage compiles them), no CUDA graphs.

Both flashinfer passes use the prefill kernel its rule picks (``flashinfer_backend.prefill_kernel``: FA2 for chunks
whose FA3 work items leave SMs idle). Times are medians of CUDA-event timings (``bench.common``) of
``ModelRunner.prefill`` alone: no embedding, positions or sampling. The floor of a short chunk is reading the
language model's weights once (``runtime_bench.Sizes``, batch 1). Writes ``<out>/prefill_probe.json``: a row per
pass, chunk and context, and each pass's set-up time (``setup_s``: the graphs' capture, the layers' compile).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from backends.runtime.language_model.compile import compile_decoder_layers  # noqa: E402
from backends.runtime.language_model.kv_cache import pages_needed  # noqa: E402
from backends.runtime.model_runner import PrefillChunk  # noqa: E402
from bench.common import cuda_time_ms, write  # noqa: E402
from bench.runtime_bench import PAGE, make_runner, start  # noqa: E402

PASSES = ("eager", "graphs", "compiled")


def chunk_over_context(runner, sizes, n: int, context: int) -> PrefillChunk:
    """``n`` random text tokens at KV indices ``context .. context + n - 1`` of pages ``0 ..`` (the cached prefix's
    KV is whatever the pool holds: its values do not change the time)."""
    positions = torch.arange(context, context + n, device=runner.device).expand(runner.family.position_rows, -1)
    return PrefillChunk(runner.embed(sizes.random_ids(n)), positions, context,
                        list(range(pages_needed(context + n, PAGE))), want_logits=True)


def measure(runner, sizes, tokens: list[int], contexts: list[int], repeats: int, label: str) -> list[dict]:
    rows = []
    for context in contexts:
        for n in tokens:
            chunk = chunk_over_context(runner, sizes, n, context)
            ms = cuda_time_ms(lambda: runner.prefill([chunk]), repeats)
            floor = sizes.decode_floor_ms(1, 0)
            rows.append({"pass": label, "tokens": n, "context": context, "ms": ms, "weights_floor_ms": floor})
            print(f"{label:8s} prefill {n:4d} tokens over {context:6d}: {ms:7.2f} ms (weights floor {floor:.2f} ms)",
                  flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for prefill_probe.json")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 117, 256, 512])
    parser.add_argument("--contexts", type=int, nargs="+", default=[0, 14432, 106960])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES),
                        help="which passes to run (always in the order eager, graphs, compiled)")
    args = parser.parse_args()
    results, model, sizes = start("prefill_probe")
    runner = make_runner(model, "flashinfer", pages_needed(max(args.contexts) + max(args.tokens), PAGE))
    results["rows"], results["setup_s"] = [], {}
    for label in (p for p in PASSES if p in args.passes):
        started = time.perf_counter()
        if label == "graphs":
            runner.enable_prefill_graphs()
        elif label == "compiled":
            runner.prefill_graphs = None  # eager steps again, now with the layers compiled
            compile_decoder_layers(model.model.language_model)
            runner.prefill([chunk_over_context(runner, sizes, 7, 0)])  # compiles (dynamic shapes: once)
        results["setup_s"][label] = time.perf_counter() - started
        results["rows"] += measure(runner, sizes, args.tokens, args.contexts, args.repeats, label)
    write(Path(args.out), "prefill_probe", results)


if __name__ == "__main__":
    main()
