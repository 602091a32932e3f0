"""Vision-encoder throughput (issue 4): Qwen2.5-VL-7B's vision tower, transformers' sdpa path vs our speed-ups.

    python3 bench/vision_bench.py [--out DIR] [--repeats 10]     # needs a CUDA GPU

The tower alone (``Qwen2_5_VisionTransformerPretrainedModel`` from the ``qwen2_5_vl_7b`` preset's vision
config: 32 blocks, hidden 1280, 16 heads of 80, gated-SiLU MLP of 3420, windows of 8x8 patches, full
attention in blocks 7, 15, 23, 31) in bfloat16 on cuda:0 with seeded dummy weights. One model, changed step
by step, each variant adding to the one before (all cases run for one variant before the next is applied):
* ``transformers_sdpa``: the baseline, one SDPA call per window or frame;
* ``varlen``: ``backends.runtime.vision.attention`` (one call per layer, windows batched by length);
* ``padded``: + ``vision_speed.pad_vision_mlp`` (MLP width 3420 -> 3424, 16-byte aligned bf16 rows);
* ``compiled``: + ``vision_speed.compile_vision_blocks`` (``torch.compile(dynamic=True)`` of each block and
  the merger, the attention a graph break), which ``ModelRunner`` does on CUDA;
* ``tensor_parallel_<N>`` (with ``--tp-gpus N``): a fresh tower of the same weights, varlen and padded, split
  over N GPUs (``backends.runtime.vision.tensor_parallel``: heads and MLP width, two NCCL all-reduces per block), compiled;
  ``tensor_parallel_<N>_tp<K>`` with ``--tp-size K`` too: N/K towers of K GPUs, the items dealt over them.
Cases: a 120-frame 448x252 video, grid_thw (60, 18, 32) = 34,560 patches; 16 images of 1024x1024
(smart_resize: 1036x1036, grid (1, 74, 74)) = 87,616 patches in one call; and a mix of an image, a video
and a small image (new grids: the compiled variant must not recompile for them). Each: one first forward
timed on the host (the compiled variant's includes compilation), ``--warmup`` more, then the median of
``--repeats`` forwards timed with CUDA events (grid_thw's host-side window arithmetic included, as in
serving). Reports patches/s, MFU against 790 TFLOP/s (dense bf16, the issue's figure) with the FLOPs of
:func:`vision_flops` (the real MLP width, not the padding), the speed-up and the largest difference from
the baseline's output, peak memory, and the graphs dynamo compiled during the case. Writes
``<out>/vision_bench.json`` (after every variant, so a failure keeps what ran) and ``vision_bench.png``.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from transformers import Qwen2_5_VLVisionConfig  # noqa: E402
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel  # noqa: E402
from transformers.vision_utils import get_vision_cu_seqlens, get_vision_window_index  # noqa: E402

from backends.runtime.vision.attention import use_varlen_vision_attention  # noqa: E402
from backends.runtime.presets import PRESETS  # noqa: E402
from backends.runtime.vision.speed import compile_vision_blocks, pad_vision_mlp  # noqa: E402
from bench.common import H200_BF16_FLOPS, bar_chart, cuda_times_ms, header, write  # noqa: E402

PEAK_FLOPS = H200_BF16_FLOPS  # dense bf16 FLOP/s the issue measures MFU against
CASES = {  # name: grid_thw rows
    "video_120f_448x252": [(60, 18, 32)],
    "images_16x1024x1024": [(1, 74, 74)] * 16,
    "mixed_image_video_small": [(1, 36, 64), (4, 18, 32), (1, 20, 20)],
}
VARIANTS = ("transformers_sdpa", "varlen", "padded", "compiled")
BASELINE = "transformers_sdpa"


def vision_flops(config: Qwen2_5_VLVisionConfig, grid_thw: list[tuple[int, int, int]]) -> dict[str, int]:
    """Matmul FLOPs of one tower forward over ``grid_thw`` (one multiply-add = 2 FLOPs), by part.

    T patches, hidden D, MLP width I (the config's ``intermediate_size``: the real width, 3420 for the 7B, not
    the padded one, whose zero features do no useful work), merged width M = D * merge**2, output width O:
    * patch embed: the Conv3d whose kernel equals its stride is a linear 1176 -> D: ``2*T*1176*D``;
    * per block: qkv ``2*T*D*3D``, output projection ``2*T*D*D``, gated-SiLU MLP (gate, up, down)
      ``2*T*3*D*I``, attention ``4*sum(L_i^2)*D`` over that block's segments L_i (QK^T and PV, each
      ``2*L^2*D`` summed over heads): the windows of transformers' ``get_vision_window_index`` in window
      blocks, the frames (temporal patches) of ``get_vision_cu_seqlens`` in ``fullatt_block_indexes``;
    * merger on T/merge**2 rows: ``2*(T/merge**2)*(M*M + M*O)``.
    Norms, rotary embedding, softmax and activations are not counted (no matmul FLOPs).
    """
    grid = torch.tensor(grid_thw)
    tokens = int(grid.prod(-1).sum())
    hidden, inter, out = config.hidden_size, config.intermediate_size, config.out_hidden_size
    merge_unit = config.spatial_merge_size**2
    merged = hidden * merge_unit
    patch_in = config.in_channels * config.temporal_patch_size * config.patch_size**2
    _, cu_windows = get_vision_window_index(grid, config.spatial_merge_size, config.window_size, config.patch_size)
    cu_frames = get_vision_cu_seqlens(grid)

    def squares(cu: torch.Tensor) -> int:
        return int(((cu[1:] - cu[:-1]).long() ** 2).sum())

    full = set(config.fullatt_block_indexes)
    attention = sum(4 * (squares(cu_frames) if i in full else squares(cu_windows)) * hidden
                    for i in range(config.depth))
    parts = {
        "patch_embed": 2 * tokens * patch_in * hidden,
        "qkv": config.depth * 2 * tokens * hidden * 3 * hidden,
        "proj": config.depth * 2 * tokens * hidden * hidden,
        "mlp": config.depth * 2 * tokens * 3 * hidden * inter,
        "attention": attention,
        "merger": 2 * (tokens // merge_unit) * (merged * merged + merged * out),
    }
    parts["total"] = sum(parts.values())
    return parts


def build_tower(device: torch.device, seed: int) -> Qwen2_5_VisionTransformerPretrainedModel:
    config = Qwen2_5_VLVisionConfig(**PRESETS["qwen2_5_vl_7b"]["vision_config"])
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[device.index or 0]), device:
        torch.manual_seed(seed)
        tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(config, dtype=torch.bfloat16)
    return tower.eval()


def apply_variant(tower: Qwen2_5_VisionTransformerPretrainedModel, name: str) -> None:
    """Turn the tower into ``name`` from the variant before it in :data:`VARIANTS`."""
    if name == "transformers_sdpa":
        tower.config._attn_implementation = "sdpa"
    elif name == "varlen":
        use_varlen_vision_attention(tower)
    elif name == "padded":
        pad_vision_mlp(tower)
    elif name == "compiled":
        compile_vision_blocks(tower)


def tensor_parallel_tower(device: torch.device, seed: int, gpus: int, tp: int | None):
    """The same tower (same seed) split over cuda:0 .. gpus-1 (``backends.runtime.vision.tensor_parallel``), compiled as
    ``ModelRunner`` does; returns (the rank-0 driver, forward(pixels, grid) -> merged rows)."""
    from backends.runtime.vision.tensor_parallel import VisionTensorParallel

    tower = build_tower(device, seed)
    for name in VARIANTS[1:3]:  # varlen, padded (compiled after the split)
        apply_variant(tower, name)
    split = VisionTensorParallel(tower, [torch.device("cuda", g) for g in range(1, gpus)], compile_vision_blocks, tp=tp)

    def forward(pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:  # the items of one call, in order
        items = zip(pixels.split(grid.prod(-1).tolist()), (tuple(row) for row in grid.tolist()))
        return torch.cat(split.encode_many(list(items)))

    return split, forward


@torch.inference_mode()
def time_forward(forward, pixels: torch.Tensor, grid: torch.Tensor, warmup: int, repeats: int) -> dict:
    """For ``forward(pixels, grid)`` (merged rows): seconds of the first forward (host clock), milliseconds of each
    timed forward (CUDA events), the last output, peak bytes allocated, and the graphs dynamo compiled meanwhile."""
    graphs = counters["stats"]["unique_graphs"]
    torch.cuda.synchronize()
    start = time.perf_counter()
    forward(pixels, grid)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - start
    for _ in range(warmup):
        forward(pixels, grid)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    last: dict[str, torch.Tensor] = {}
    times = cuda_times_ms(lambda: last.update(out=forward(pixels, grid)), repeats, warmup=0)
    return {"first_s": first_s, "times_ms": times, "out": last["out"], "peak": torch.cuda.max_memory_allocated(),
            "graphs": counters["stats"]["unique_graphs"] - graphs}


def run(args: argparse.Namespace, out: Path, device: torch.device) -> dict:
    tower = build_tower(device, args.seed)
    results = header(device)
    results["versions"]["cuda"] = torch.version.cuda
    results.update(peak_flops=PEAK_FLOPS, dtype="bfloat16", warmup=args.warmup, repeats=args.repeats,
                   baseline=BASELINE, variants=list(args.variants), cases={})
    if args.tp_gpus > 1:
        results["variants"].append(f"tensor_parallel_{args.tp_gpus}" + (f"_tp{args.tp_size}" if args.tp_size else ""))
    inputs, baseline = {}, {}
    for case in args.cases:
        grid_thw = CASES[case]
        grid = torch.tensor(grid_thw, device=device)
        generator = torch.Generator(device).manual_seed(args.seed)
        patches = int(grid.prod(-1).sum())
        inputs[case] = (grid, torch.randn(patches, 1176, device=device, generator=generator).to(torch.bfloat16))
        results["cases"][case] = {"grid_thw": grid_thw, "patches": patches,
                                  "flops": vision_flops(tower.config, grid_thw)}

    def whole(pixels, grid):
        return tower(pixels, grid_thw=grid).pooler_output

    split, forward = None, whole
    for name in results["variants"]:
        try:
            if name.startswith("tensor_parallel"):
                split, forward = tensor_parallel_tower(device, args.seed, args.tp_gpus, args.tp_size)
            else:
                apply_variant(tower, name)
            for case in args.cases:
                entry, (grid, pixels) = results["cases"][case], inputs[case]
                timed = time_forward(forward, pixels, grid, args.warmup, args.repeats)
                median_s = statistics.median(timed["times_ms"]) / 1e3
                row = {"median_ms": median_s * 1e3, "times_ms": timed["times_ms"],
                       "patches_per_s": entry["patches"] / median_s,
                       "tflops_per_s": entry["flops"]["total"] / median_s / 1e12,
                       "mfu": entry["flops"]["total"] / median_s / PEAK_FLOPS,
                       "peak_memory_gib": timed["peak"] / 2**30, "first_forward_s": timed["first_s"],
                       "graphs_compiled": timed["graphs"]}
                entry[name] = row
                if name == BASELINE:
                    baseline[case] = timed["out"]
                if case in baseline:
                    ours, theirs = timed["out"].float(), baseline[case].float()
                    row["speedup"] = entry[BASELINE]["median_ms"] / row["median_ms"]
                    # Relative to the output's scale: elementwise ratios blow up at near-zero entries.
                    row["max_abs_err"] = float((ours - theirs).abs().max())
                    row["max_rel_err"] = row["max_abs_err"] / float(theirs.abs().max())
                print(f"{case} {name}: {row['median_ms']:.1f} ms, {row['patches_per_s']:,.0f} patches/s, "
                      f"MFU {row['mfu']:.1%}, {row.get('speedup', float('nan')):.2f}x, "
                      f"rel err {row.get('max_rel_err', float('nan')):.1e}, "
                      f"first forward {row['first_forward_s']:.1f} s, {row['graphs_compiled']} graphs compiled",
                      flush=True)
                del timed
        except Exception as error:  # keep the variants that ran; the error goes into the JSON
            results.setdefault("errors", {})[name] = f"{type(error).__name__}: {error}"
            print(f"{name} failed: {results['errors'][name]}", flush=True)
        write(out, "vision_bench", results)
    if split is not None:
        split.close()
    return results


def plot(results: dict, path: Path) -> None:
    """One bar per case and variant: patches/s, with MFU and the speed-up over the baseline."""
    rows = []
    for case, entry in results["cases"].items():
        for name in results["variants"]:
            if name in entry:
                row = entry[name]
                rows.append((f"{case} {name}", row["patches_per_s"],
                             f"{row['patches_per_s']:,.0f}/s  MFU {row['mfu']:.0%}  {row.get('speedup', 1):.2f}x"))
    bar_chart(f"Qwen2.5-VL-7B vision tower, bf16, patches/s, {results['device']} ({results['date']})", rows, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out",
                        help="folder for vision_bench.json/.png (default results/vision-<date> beside this script)")
    parser.add_argument("--repeats", type=int, default=10, help="timed forwards per case and variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed forwards after the first")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                        help="in this order; each adds to the ones before it")
    parser.add_argument("--seed", type=int, default=0, help="seed of the dummy weights and pixels")
    parser.add_argument("--tp-gpus", type=int, default=1,
                        help="also the tower split over this many GPUs (backends.runtime.vision.tensor_parallel), after the variants")
    parser.add_argument("--tp-size", type=int, help="GPUs per split tower (default all --tp-gpus): hybrid DP x TP")
    args = parser.parse_args()
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be at least 1 and --warmup at least 0")
    if not torch.cuda.is_available():
        sys.exit("vision_bench.py needs a CUDA GPU: torch.cuda.is_available() is False here "
                 f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    out = Path(args.out or Path(__file__).parent / "results" / f"vision-{datetime.date.today().isoformat()}")
    results = run(args, out, torch.device("cuda", 0))
    plot(results, out / "vision_bench.png")
    print(f"wrote {write(out, 'vision_bench', results)} and vision_bench.png")


if __name__ == "__main__":
    main()
