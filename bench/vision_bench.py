"""Vision-encoder throughput (issue 4): Qwen2.5-VL-7B's vision tower, transformers' sdpa path vs our varlen attention.

    python3 bench/vision_bench.py --out bench/results/vision-h200 [--repeats 10]     # needs a CUDA GPU

The tower alone (``Qwen2_5_VisionTransformerPretrainedModel`` from the ``qwen2_5_vl_7b`` preset's vision
config: 32 blocks, hidden 1280, 16 heads of 80, gated-SiLU MLP of 3420, windows of 8x8 patches, full
attention in blocks 7, 15, 23, 31) in bfloat16 on cuda:0 with seeded dummy weights. One model, two attention
implementations switched on its config: transformers' ``sdpa`` (one SDPA call per window or frame) and
``backends.runtime.attention.vision`` (one call per layer, windows batched by length). Cases: a 120-frame
448x252 video, grid_thw (60, 18, 32) = 34,560 patches, and 16 images of 1024x1024 (smart_resize: 1036x1036,
grid (1, 74, 74)) = 87,616 patches in one call. Each: warm-up, then the median of ``--repeats`` forwards
timed with CUDA events (grid_thw's host-side window arithmetic included, as in serving). Reports patches/s,
the speed ratio, MFU against 790 TFLOP/s (dense bf16, the issue's figure) with the FLOPs of
:func:`vision_flops`, peak memory, and how far the two outputs differ. Writes ``<out>/vision_bench.json``
and, where matplotlib is importable, ``<out>/vision_bench.png``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import Qwen2_5_VLVisionConfig  # noqa: E402
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel  # noqa: E402
from transformers.vision_utils import get_vision_cu_seqlens, get_vision_window_index  # noqa: E402

from backends.runtime.attention.vision import use_varlen_vision_attention  # noqa: E402
from backends.runtime.presets import PRESETS  # noqa: E402

PEAK_FLOPS = 790e12  # dense bf16 FLOP/s the issue measures MFU against
CASES = {  # name: grid_thw rows
    "video_120f_448x252": [(60, 18, 32)],
    "images_16x1024x1024": [(1, 74, 74)] * 16,
}
IMPLEMENTATIONS = ("transformers_sdpa", "varlen")


def vision_flops(config: Qwen2_5_VLVisionConfig, grid_thw: list[tuple[int, int, int]]) -> dict[str, int]:
    """Matmul FLOPs of one tower forward over ``grid_thw`` (one multiply-add = 2 FLOPs), by part.

    T patches, hidden D, MLP width I, merged width M = D * merge**2, output width O:
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


def set_implementation(tower: Qwen2_5_VisionTransformerPretrainedModel, name: str) -> None:
    if name == "varlen":
        use_varlen_vision_attention(tower)
    else:
        tower.config._attn_implementation = "sdpa"


@torch.inference_mode()
def time_forward(tower, pixels: torch.Tensor, grid: torch.Tensor, warmup: int, repeats: int
                 ) -> tuple[list[float], torch.Tensor, int]:
    """Milliseconds of each timed forward (CUDA events), the last output (merged rows), peak bytes allocated."""
    for _ in range(warmup):
        tower(pixels, grid_thw=grid)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, out = [], None
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = tower(pixels, grid_thw=grid).pooler_output
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times, out, torch.cuda.max_memory_allocated()


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cuda", 0)
    tower = build_tower(device, args.seed)
    results = {"device": torch.cuda.get_device_name(device),
               "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "versions": {"python": platform.python_version(), "torch": torch.__version__,
                            "cuda": torch.version.cuda, "transformers": transformers.__version__},
               "peak_flops": PEAK_FLOPS, "dtype": "bfloat16", "warmup": args.warmup, "repeats": args.repeats,
               "baseline": "transformers_sdpa", "cases": {}}
    for case in args.cases:
        grid_thw = CASES[case]
        grid = torch.tensor(grid_thw, device=device)
        generator = torch.Generator(device).manual_seed(args.seed)
        patches = int(grid.prod(-1).sum())
        pixels = torch.randn(patches, 1176, device=device, generator=generator).to(torch.bfloat16)
        flops = vision_flops(tower.config, grid_thw)
        entry = {"grid_thw": grid_thw, "patches": patches, "flops": flops}
        outputs = {}
        for name in IMPLEMENTATIONS:
            set_implementation(tower, name)
            times, outputs[name], peak = time_forward(tower, pixels, grid, args.warmup, args.repeats)
            median_s = statistics.median(times) / 1e3
            entry[name] = {"median_ms": median_s * 1e3, "times_ms": times, "patches_per_s": patches / median_s,
                           "tflops_per_s": flops["total"] / median_s / 1e12,
                           "mfu": flops["total"] / median_s / PEAK_FLOPS, "peak_memory_gib": peak / 2**30}
            print(f"{case} {name}: {entry[name]['median_ms']:.1f} ms, {entry[name]['patches_per_s']:,.0f} patches/s, "
                  f"MFU {entry[name]['mfu']:.1%}", flush=True)
        ours, theirs = outputs["varlen"].float(), outputs["transformers_sdpa"].float()
        entry["speedup"] = entry["transformers_sdpa"]["median_ms"] / entry["varlen"]["median_ms"]
        # Relative to the output's scale: elementwise ratios blow up at near-zero entries.
        entry["max_abs_err"] = float((ours - theirs).abs().max())
        entry["max_rel_err"] = entry["max_abs_err"] / float(theirs.abs().max())
        print(f"{case}: speedup {entry['speedup']:.2f}x, "
              f"max |ours - theirs| / max |theirs| = {entry['max_rel_err']:.2e}", flush=True)
        results["cases"][case] = entry
        del outputs, pixels
        torch.cuda.empty_cache()
    set_implementation(tower, "transformers_sdpa")
    return results


def plot(results: dict, path: Path) -> bool:
    """Bars of patches/s per case and implementation, MFU on top; False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cases = list(results["cases"])
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    for k, name in enumerate(IMPLEMENTATIONS):
        xs = [i + (k - 0.5) * width for i in range(len(cases))]
        rates = [results["cases"][c][name]["patches_per_s"] for c in cases]
        bars = ax.bar(xs, rates, width, label=name)
        for bar, case in zip(bars, cases):
            ax.annotate(f"MFU {results['cases'][case][name]['mfu']:.0%}", (bar.get_x() + bar.get_width() / 2,
                        bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(cases)), cases)
    ax.set_ylabel("patches / s")
    ax.set_title(f"Qwen2.5-VL-7B vision tower, bf16, {results['device']}", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for vision_bench.json/.png (default bench/results/vision-<date>)")
    parser.add_argument("--repeats", type=int, default=10, help="timed forwards per case and implementation")
    parser.add_argument("--warmup", type=int, default=2, help="untimed forwards before them")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--seed", type=int, default=0, help="seed of the dummy weights and pixels")
    args = parser.parse_args()
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be at least 1 and --warmup at least 0")
    if not torch.cuda.is_available():
        sys.exit("vision_bench.py needs a CUDA GPU: torch.cuda.is_available() is False here "
                 f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    out = Path(args.out or Path(__file__).parent / "results" / f"vision-{datetime.date.today().isoformat()}")
    out.mkdir(parents=True, exist_ok=True)
    results = run(args)
    (out / "vision_bench.json").write_text(json.dumps(results, indent=1))
    plotted = plot(results, out / "vision_bench.png")
    print(f"wrote {out / 'vision_bench.json'}" + (" and vision_bench.png" if plotted else " (no matplotlib: no plot)"))


if __name__ == "__main__":
    main()
