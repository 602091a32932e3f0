"""The sampler alone (``backends/runtime/sampling/sampler.py``) on the GPU: what a decode step pays for its tokens.

    python3 bench/sampler_bench.py --out DIR [--batches 1 8 32 64 128 256]

For float32 ``[batch, vocab]`` logits (Qwen2.5-VL's 151,936 tokens), every row with the same parameters, per
kind of parameters (greedy, temperature, top-k, top-p, both, seeded; greedy with the sampled tokens' log
probabilities and 5 top tokens, ``backends/runtime/sampling/logprobs.py``, for every row and for every other row)
and a mixed batch, each as a decode step runs it (the log-softmax of the asking rows, sampling, their figures):

* ``gpu_ms``: the sampler's kernels alone, launched while the GPU is busy (the host's launches hidden, as in
  the decode stage, where the sampler is launched behind the step's graph replay);
* ``host_ms``: the host's time to launch them (hidden behind the replay while shorter than it);
* ``total_ms``: from an idle GPU to the tokens (or the figures) read (host and GPU in series; what earlier
  ``decode_profile`` runs reported as ``sampling_ms``).

Baselines in the same run, GPU time: ``eager_race``: the race uncompiled (what the sampler ran before it was
compiled); ``sort_top_p``: top-p's threshold from a
sort of the vocabulary (the CPU path, and the CUDA path for rows without a top-k before flashinfer's
``top_p_renorm_probs``);
``torch_exponential``: softmax and an exponential race drawn from torch's own RNG
(vLLM's plain-torch sampler; no seeds and no batch independence, so not an option, only a speed reference).

Writes ``<out>/sampler_bench.json`` and ``.png``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from backends.runtime.sampling import logprobs, sampler  # noqa: E402
from backends.runtime.sampling.sampler import SamplingParams, sample_tensor  # noqa: E402
from bench.common import bar_chart, cuda_time_ms, header, write  # noqa: E402

VOCAB = 151_936
KINDS = {"greedy": SamplingParams(temperature=0), "temperature": SamplingParams(temperature=0.7),
         "top_k_50": SamplingParams(temperature=0.7, top_k=50), "top_p_0.9": SamplingParams(temperature=0.7, top_p=0.9),
         "top_k_50_top_p_0.9": SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
         "seeded_top_p_0.9": SamplingParams(temperature=0.7, top_p=0.9, seed=1),
         "min_p_0.05": SamplingParams(temperature=0.7, min_p=0.05),
         "greedy_logprobs_5": SamplingParams(temperature=0, logprobs=5)}
MIXED = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=20),
         SamplingParams(temperature=0.8, top_p=0.95, seed=3)]
BUSY_CYCLES = 40_000_000  # about 20 ms at the H200's clock: longer than any launch sequence timed here


def step(logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> torch.Tensor:
    """What a decode step launches for its tokens: the asking rows' log-softmax, the sampler, their figures (the
    tokens when no row asks)."""
    asking = logprobs.start(logits, params)
    tokens = sample_tensor(logits, params, steps, [VOCAB - 1])
    return tokens if asking is None else logprobs.finish(*asking, tokens)


def gpu_ms(fn, repeats: int = 20) -> float:
    """Median CUDA-event time of ``fn()``'s kernels alone: they are queued behind a sleeping kernel, so the
    host's launch time does not count."""
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(BUSY_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_ms(fn, repeats: int = 20) -> float:
    """Median host time of ``fn()`` (launches only; the GPU is kept busy so nothing waits for it)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(BUSY_CYCLES)
        begin = time.perf_counter()
        fn()
        times.append((time.perf_counter() - begin) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def baselines(logits: torch.Tensor, params: SamplingParams) -> dict[str, float]:
    """GPU milliseconds of the race uncompiled, of top-p's threshold from a sort, and of torch's own race."""
    rows, vocab = logits.shape
    keys = torch.arange(rows, device=logits.device)
    token_hash = sampler._token_hash(vocab, logits.device)
    out = {"eager_race": gpu_ms(lambda: sampler._race(logits / params.temperature, keys, token_hash))}
    if params.top_p < 1:
        top_p = torch.full((rows,), params.top_p, device=logits.device)
        temperature = torch.full((rows, 1), params.temperature, device=logits.device)
        out["sort_top_p"] = gpu_ms(lambda: sampler._top_p_threshold(
            logits, logits.sort(dim=-1, descending=True).values, top_p, temperature))
    out["torch_exponential"] = gpu_ms(
        lambda: (logits / params.temperature).softmax(-1).div_(torch.empty_like(logits).exponential_()).argmax(-1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32, 64, 128, 256])
    args = parser.parse_args()
    device = torch.device("cuda")
    results = header(device)
    begin = time.perf_counter()
    sampler.warm_up(device, VOCAB)
    results["warm_up_s"] = time.perf_counter() - begin
    rows, bars = [], []
    for batch in args.batches:
        logits = torch.randn(batch, VOCAB, device=device, generator=torch.Generator(device).manual_seed(batch)) * 3
        kinds = {**{name: [p] * batch for name, p in KINDS.items()}, "mixed": [MIXED[i % 4] for i in range(batch)],
                 "half_logprobs_5": [KINDS["greedy_logprobs_5" if i % 2 else "greedy"] for i in range(batch)]}
        for name, params in kinds.items():
            steps = [5] * batch
            launch = lambda params=params, steps=steps: step(logits, params, steps)  # noqa: E731
            row = {"batch": batch, "kind": name, "gpu_ms": gpu_ms(launch), "host_ms": host_ms(launch),
                   "total_ms": cuda_time_ms(lambda launch=launch: launch().tolist(), 20)}
            if name in KINDS and KINDS[name].temperature > 0:
                row["baselines_gpu_ms"] = baselines(logits, KINDS[name])
            rows.append(row)
            bars.append((f"b{batch} {name}", row["gpu_ms"], f"{row['gpu_ms']:.3f} ms GPU, host {row['host_ms']:.2f}"))
            print(f"b={batch:4d} {name:20s} GPU {row['gpu_ms']:.3f} ms, host {row['host_ms']:.3f} ms, "
                  f"total {row['total_ms']:.3f} ms; baselines (GPU ms) {row.get('baselines_gpu_ms', {})}", flush=True)
    results["vocab"] = VOCAB
    results["sampling"] = rows
    write(Path(args.out), "sampler_bench", results)
    bar_chart("sampler: GPU time per step", bars, Path(args.out) / "sampler_bench.png")


if __name__ == "__main__":
    main()
