"""Where a decode step's time goes (issue 4): Qwen2.5-VL-7B's language model, dummy bf16 weights, one GPU.

    python3 bench/decode_profile.py --out DIR [--batches 1 64] [--context 4096]

For each batch size, with the decoder layers compiled and the step in a CUDA graph (the serving setup):

* ``step_ms``: the whole step as ``runtime_bench`` times it (host layout + plan + replay + greedy token read);
  ``step_ahead_ms``: the same with the next step planned while the GPU runs this one, as the decode stage does;
* ``host_ms``: the host part before the replay (the step's paged layout, flashinfer's ``plan()``, staging),
  timed on the host clock, and where it goes (cProfile); ``replay_ms``: the graph replay alone, timed with CUDA events;
* ``kernels``: one replay's kernels from ``torch.profiler``, summed by kind (matrix products, attention, KV
  writes, fused elementwise, other), their count, and the replay's idle time between them;
* ``linears``: every linear layer of the step (and the LM head) replayed alone in a graph, as the runner runs
  them (q/k/v and gate/up concatenated into one product each, ``backends/runtime/language_model/fuse.py``) and as
  transformers' layers do (five products): the weight-streaming time and bandwidth against 4.3 TB/s;
* ``attention``: the 28 layers' KV writes + flashinfer decode alone, in a graph: time and KV bandwidth.

The sampler alone: ``bench/sampler_bench.py``.

Writes ``<out>/decode_profile.json`` and prints a table.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from backends.runtime.language_model.cuda_graphs import batch_ladder  # noqa: E402
from backends.runtime.language_model.kv_cache import pages_needed  # noqa: E402
from backends.runtime.language_model.compile import compile_decoder_layers  # noqa: E402
from bench.common import H200_HBM_BYTES_PER_S, cuda_time_ms, graph_ms, write  # noqa: E402
from bench.runtime_bench import DEVICE, PAGE, decode_batch, decode_step, decode_step_ahead, make_runner, start  # noqa: E402

KINDS = (("matmul", ("gemm", "gemv", "cutlass", "xmma", "cublas", "splitk", "sm90")),
         ("kv_write", ("appendpagedkv", "index_put", "indexing", "scatter")),
         ("attention", ("flashinfer", "batchprefill", "batchdecode", "merge", "persistent")),
         ("fused_elementwise", ("triton",)))


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def profile_kernels(run) -> dict:
    """Kernels of one ``run()`` (the third of three profiled), summed by kind, with the idle time between them."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            run()
            torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and not e.name.startswith(("Memcpy", "Memset"))),
                     key=lambda e: e.time_range.start)
    if not kernels:
        return {"seen": 0}
    per_step = len(kernels) // 3
    last = kernels[-per_step:]
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in last:
        us = e.time_range.end - e.time_range.start
        for table, key in ((by_kind, kind_of(e.name)), (by_name, e.name[:90])):
            table[key][0] += us
            table[key][1] += 1
    span = last[-1].time_range.end - last[0].time_range.start
    busy = sum(v[0] for v in by_kind.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]
    return {"kernels": len(last), "span_us": span, "busy_us": busy, "idle_us": span - busy,
            "by_kind_us": {k: {"us": v[0], "count": v[1]} for k, v in by_kind.items()},
            "top_kernels_us": [{"name": n, "us": v[0], "count": v[1]} for n, v in top],
            "first_layer": [{"name": e.name[:60], "us": e.time_range.end - e.time_range.start,
                             "gap_before_us": e.time_range.start - p.time_range.end}
                            for p, e in zip(last[:40], last[1:41])]}


def linears(model, batch: int, fused: bool) -> float:
    """Graph time of every linear layer of one step (plus the LM head) on a random ``[batch, hidden]`` input:
    the runner's fused ``qkv_proj``/``gate_up_proj``, or (``fused=False``) their row blocks one product each, as
    transformers' layers run them."""
    lm = model.model.language_model
    x = torch.randn(batch, lm.config.hidden_size, device=DEVICE, dtype=model.dtype)
    steps = []
    for layer in lm.layers:
        a, m = layer.self_attn, layer.mlp
        if fused:
            steps.append(lambda a=a, m=m: (a.o_proj(a.qkv_proj(x)[:, :x.shape[1]]),
                                           m.down_proj(m.gate_up_proj(x)[:, :m.intermediate_size])))
        else:
            qkv = list(zip(a.qkv_proj.weight.split(a.qkv_sizes), a.qkv_proj.bias.split(a.qkv_sizes)))
            gate, up = m.gate_up_proj.weight.chunk(2)
            steps.append(lambda a=a, m=m, qkv=qkv, gate=gate, up=up: (
                a.o_proj(F.linear(x, *qkv[0])), F.linear(x, *qkv[1]), F.linear(x, *qkv[2]),
                m.down_proj(F.linear(x, gate) * F.linear(x, up))))

    def body():
        for step in steps:
            step()
        model.lm_head(x)

    with torch.inference_mode():
        return graph_ms(body)


def attention(runner, seqs) -> float:
    """Graph time of the KV writes and flashinfer decode of all layers for ``seqs`` (planned by ``stage``)."""
    g = runner.graphs.stage(seqs)
    num_qo, num_kv, dim, _ = g.backend.shape
    q = torch.randn(g.batch_size, num_qo, dim, device=DEVICE, dtype=runner.dtype)
    k = torch.randn(g.batch_size, num_kv, dim, device=DEVICE, dtype=runner.dtype)
    layers = runner.kv_cache.shape[0]

    def body():
        for layer in range(layers):
            g.backend.forward(layer, q, k, k, runner.kv_cache)

    with torch.inference_mode():
        return graph_ms(body)


def host_and_replay(runner, seqs) -> tuple[float, float, list[str]]:
    """Median host time of :meth:`DecodeGraphs.stage` and CUDA-event time of the replay alone (ms), and the
    functions that take stage's host time (cProfile, by own time)."""
    host = []
    for _ in range(50):
        torch.cuda.synchronize()
        start = time.perf_counter()
        g = runner.graphs.stage(seqs)
        host.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(20):
        runner.graphs.stage(seqs)
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
    return statistics.median(host), cuda_time_ms(g.graph.replay, 50), text.getvalue().splitlines()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 64])
    parser.add_argument("--context", type=int, default=4096)
    args = parser.parse_args()
    results, model, sizes = start("decode_profile")
    per_seq = pages_needed(args.context + 1, PAGE)
    runner = make_runner(model, "flashinfer", max(args.batches) * per_seq)
    compile_decoder_layers(model.model.language_model)
    runner.enable_cuda_graphs(batch_ladder(max(args.batches)))
    rows = []
    linear_bytes = sizes.read_bytes - sum(p.numel() * p.element_size() for n, p in
                                          model.model.language_model.named_parameters() if "norm" in n)
    for batch in args.batches:
        seqs = decode_batch(batch, args.context, per_seq)
        with torch.inference_mode():
            step = cuda_time_ms(lambda: decode_step(runner, seqs), 30)
            ahead = cuda_time_ms(lambda: decode_step_ahead(runner, seqs), 30)
            host, replay, host_profile = host_and_replay(runner, seqs)
            kernels = profile_kernels(runner.graphs.stage(seqs).graph.replay)
            graphs, runner.graphs = runner.graphs, None
            kernels_eager = profile_kernels(lambda: runner.decode(seqs))  # same kernels, launched one by one
            runner.graphs = graphs
        sep, fused = linears(model, batch, False), linears(model, batch, True)
        attn = attention(runner, seqs)
        kv_bytes = batch * args.context * sizes.kv_token_bytes
        row = {"batch": batch, "context": args.context, "floor_ms": sizes.decode_floor_ms(batch, args.context),
               "step_ms": step, "step_ahead_ms": ahead, "host_ms": host, "replay_ms": replay,
               "host_profile_20_stages": host_profile, "kernels": kernels, "kernels_eager": kernels_eager,
               "linears_ms": sep, "linears_fused_ms": fused, "linear_bytes": linear_bytes,
               "linears_tb_per_s": linear_bytes / sep / 1e9, "linears_fused_tb_per_s": linear_bytes / fused / 1e9,
               "attention_ms": attn, "attention_kv_tb_per_s": kv_bytes / attn / 1e9}
        rows.append(row)
        print(f"b={batch}: step {step:.3f} ms (floor {row['floor_ms']:.3f}), planned ahead {ahead:.3f} ms, "
              f"host {host:.3f}, replay {replay:.3f}; "
              f"linears {sep:.3f} ms ({row['linears_tb_per_s']:.2f} TB/s), fused {fused:.3f} ms "
              f"({row['linears_fused_tb_per_s']:.2f} TB/s); attention {attn:.3f} ms "
              f"({row['attention_kv_tb_per_s']:.2f} TB/s KV)", flush=True)
        print("\n".join(line for line in host_profile if line.strip())[-1600:])
        for label, table in (("replay", kernels), ("eager", kernels_eager)):
            if not table.get("kernels"):
                print(f"  {label}: no kernels seen by the profiler")
                continue
            print(f"  {label}: {table['kernels']} kernels, span {table['span_us']:.0f} us, "
                  f"idle {table['idle_us']:.0f} us; " +
                  ", ".join(f"{k} {v['us']:.0f} us/{v['count']}" for k, v in table["by_kind_us"].items()))
            for t in table["top_kernels_us"][:12]:
                print(f"    {t['us']:8.1f} us {t['count']:4d}x {t['name']}")
    results["hbm_bytes_per_s"] = H200_HBM_BYTES_PER_S
    results["decode"] = rows
    write(Path(args.out), "decode_profile", results)


if __name__ == "__main__":
    main()
