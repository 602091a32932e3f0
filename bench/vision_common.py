"""What both paths of bench/vision_bench.py share (Qwen2.5-VL's tower and its speed-ups there, InternVL3's tiles as
served in bench/vision_tiles.py): one timing of a forward, the loop over variants and cases that fills the result
rows (rates, MFU against 790 TFLOP/s, speed-up and error against the baseline variant), and the chart."""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable

import torch
from torch._dynamo.utils import counters

from bench.common import H200_BF16_FLOPS, bar_chart, cuda_times_ms, write

PEAK_FLOPS = H200_BF16_FLOPS  # dense bf16 FLOP/s the issues measure MFU against
BASELINE = "transformers_sdpa"  # the variant every path starts from: the library's module as it is


@torch.inference_mode()
def time_forward(forward: Callable[[], torch.Tensor], warmup: int, repeats: int) -> dict:
    """For ``forward()`` (its output tensor): seconds of the first forward (host clock), milliseconds of each
    timed forward (CUDA events), the last output, peak bytes allocated, and the graphs dynamo compiled meanwhile."""
    graphs = counters["stats"]["unique_graphs"]
    torch.cuda.synchronize()
    start = time.perf_counter()
    forward()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - start
    for _ in range(warmup):
        forward()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    last: dict[str, torch.Tensor] = {}
    times = cuda_times_ms(lambda: last.update(out=forward()), repeats, warmup=0)
    return {"first_s": first_s, "times_ms": times, "out": last["out"], "peak": torch.cuda.max_memory_allocated(),
            "graphs": counters["stats"]["unique_graphs"] - graphs}


def time_variants(results: dict, out: Path, apply: Callable[[str], Callable[..., torch.Tensor]],
                  inputs: dict[str, tuple], units: tuple[str, ...], warmup: int, repeats: int) -> None:
    """Each variant of ``results["variants"]`` in order: ``forward = apply(name)`` (the variant made, from the one
    before it), then each case of ``inputs`` timed as ``forward(*inputs[case])`` (:func:`time_forward`) into
    ``results["cases"][case][name]``, whose ``"flops"["total"]`` and ``units`` counts (e.g. ``"patches"``) the
    case's entry holds already: ``median_ms``, ``<unit>_per_s``, TFLOP/s, MFU, peak GiB, the first forward's
    seconds, the graphs compiled, and beside :data:`BASELINE`'s output the speed-up and the largest absolute and
    relative (to the output's largest value) difference. A variant that raises is recorded in ``results["errors"]``
    and the next one runs; ``<out>/vision_bench.json`` is written after every variant."""
    baseline = {}
    for name in results["variants"]:
        try:
            forward = apply(name)
            for case, args in inputs.items():
                entry = results["cases"][case]
                timed = time_forward(lambda: forward(*args), warmup, repeats)
                median_s = statistics.median(timed["times_ms"]) / 1e3
                row = {"median_ms": median_s * 1e3, "times_ms": timed["times_ms"]}
                row.update({f"{unit}_per_s": entry[unit] / median_s for unit in units})
                row.update({"tflops_per_s": entry["flops"]["total"] / median_s / 1e12,
                            "mfu": entry["flops"]["total"] / median_s / PEAK_FLOPS,
                            "peak_memory_gib": timed["peak"] / 2**30, "first_forward_s": timed["first_s"],
                            "graphs_compiled": timed["graphs"]})
                entry[name] = row
                if name == BASELINE:
                    baseline[case] = timed["out"]
                if case in baseline:
                    ours, theirs = timed["out"].float(), baseline[case].float()
                    row["speedup"] = entry[BASELINE]["median_ms"] / row["median_ms"]
                    # Relative to the output's scale: elementwise ratios blow up at near-zero entries.
                    row["max_abs_err"] = float((ours - theirs).abs().max())
                    row["max_rel_err"] = row["max_abs_err"] / float(theirs.abs().max())
                print(f"{case} {name}: {row['median_ms']:.1f} ms, {row[units[0] + '_per_s']:,.0f} {units[0]}/s, "
                      f"MFU {row['mfu']:.1%}, {row.get('speedup', float('nan')):.2f}x, "
                      f"rel err {row.get('max_rel_err', float('nan')):.1e}, "
                      f"first forward {row['first_forward_s']:.1f} s, {row['graphs_compiled']} graphs compiled",
                      flush=True)
                del timed
        except Exception as error:  # keep the variants that ran; the error goes into the JSON
            results.setdefault("errors", {})[name] = f"{type(error).__name__}: {error}"
            print(f"{name} failed: {results['errors'][name]}", flush=True)
        write(out, "vision_bench", results)


def plot(results: dict, path: Path, title: str, unit: str) -> None:
    """One bar per case and variant: ``<unit>``/s, with MFU and the speed-up over the baseline."""
    rows = []
    for case, entry in results["cases"].items():
        for name in results["variants"]:
            if name in entry:
                row = entry[name]
                rows.append((f"{case} {name}", row[f"{unit}_per_s"],
                             f"{row[f'{unit}_per_s']:,.0f}/s  MFU {row['mfu']:.0%}  {row.get('speedup', 1):.2f}x"))
    bar_chart(f"{title}, bf16, {unit}/s, {results['device']} ({results['date']})", rows, path)
