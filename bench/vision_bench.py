"""Vision-encoder throughput (issues 4, 22): a preset's vision side, transformers' sdpa path vs ours.

    python3 bench/vision_bench.py [--out DIR] [--repeats 10] [--preset qwen2_5_vl_7b]     # needs a CUDA GPU

``--preset`` picks the path by the preset's family (:data:`PATHS`): an InternVL3 preset (``internvl3_38b``,
``internvl3_8b``, ``internvl3_tiny``) runs ``bench/vision_tiles.py`` (its tiles as UnifiedServe encodes them, a
16-image burst; its docstring says what), a Qwen2.5-VL one (default ``qwen2_5_vl_7b``; ``tiny``) what follows.

The tower alone (``Qwen2_5_VisionTransformerPretrainedModel`` from the preset's vision config; ``qwen2_5_vl_7b``'s:
32 blocks, hidden 1280, 16 heads of 80, gated-SiLU MLP of 3420, windows of 8x8 patches, full
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
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import Qwen2_5_VLVisionConfig  # noqa: E402
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel  # noqa: E402
from transformers.vision_utils import get_vision_cu_seqlens, get_vision_window_index  # noqa: E402

from backends.runtime.vision.attention import use_varlen_vision_attention  # noqa: E402
from backends.runtime.presets import PRESETS, preset_family  # noqa: E402
from backends.runtime.vision.speed import compile_vision_blocks, pad_vision_mlp  # noqa: E402
from bench import vision_tiles  # noqa: E402
from bench.common import add_preset_argument, header, write  # noqa: E402
from bench.vision_common import BASELINE, PEAK_FLOPS, plot, time_variants  # noqa: E402

CASES = {  # name: grid_thw rows
    "video_120f_448x252": [(60, 18, 32)],
    "images_16x1024x1024": [(1, 74, 74)] * 16,
    "mixed_image_video_small": [(1, 36, 64), (4, 18, 32), (1, 20, 20)],
}
VARIANTS = (BASELINE, "varlen", "padded", "compiled")


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


def build_tower(device: torch.device, seed: int, preset: str) -> Qwen2_5_VisionTransformerPretrainedModel:
    config = Qwen2_5_VLVisionConfig(**PRESETS[preset]["vision_config"])
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


def tensor_parallel_tower(device: torch.device, seed: int, preset: str, gpus: int, tp: int | None):
    """The same tower (same seed) split over cuda:0 .. gpus-1 (``backends.runtime.vision.tensor_parallel``), compiled as
    ``ModelRunner`` does; returns (the rank-0 driver, forward(pixels, grid) -> merged rows)."""
    from backends.runtime.vision.tensor_parallel import VisionTensorParallel

    tower = build_tower(device, seed, preset)
    for name in VARIANTS[1:3]:  # varlen, padded (compiled after the split)
        apply_variant(tower, name)
    split = VisionTensorParallel(tower, [torch.device("cuda", g) for g in range(1, gpus)], compile_vision_blocks, tp=tp)

    def forward(pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:  # the items of one call, in order
        items = zip(pixels.split(grid.prod(-1).tolist()), (tuple(row) for row in grid.tolist()))
        return torch.cat(split.encode_many(list(items)))

    return split, forward


def run(args: argparse.Namespace, out: Path, device: torch.device) -> dict:
    """The Qwen2.5-VL tower's variants and cases (the module docstring), written to ``out`` as they run."""
    tower = build_tower(device, args.seed, args.preset)
    results = header(device)
    results["versions"]["cuda"] = torch.version.cuda
    results.update(preset=args.preset, peak_flops=PEAK_FLOPS, dtype="bfloat16", warmup=args.warmup,
                   repeats=args.repeats, baseline=BASELINE, variants=list(args.variants), cases={})
    if args.tp_gpus > 1:
        results["variants"].append(f"tensor_parallel_{args.tp_gpus}" + (f"_tp{args.tp_size}" if args.tp_size else ""))
    inputs = {}
    for case in args.cases:
        grid_thw = CASES[case]
        grid = torch.tensor(grid_thw, device=device)
        generator = torch.Generator(device).manual_seed(args.seed)
        patches = int(grid.prod(-1).sum())
        inputs[case] = (torch.randn(patches, 1176, device=device, generator=generator).to(torch.bfloat16), grid)
        results["cases"][case] = {"grid_thw": grid_thw, "patches": patches,
                                  "flops": vision_flops(tower.config, grid_thw)}

    def whole(pixels, grid):
        return tower(pixels, grid_thw=grid).pooler_output

    splits = []

    def apply(name: str):
        if not name.startswith("tensor_parallel"):
            apply_variant(tower, name)
            return whole
        split, forward = tensor_parallel_tower(device, args.seed, args.preset, args.tp_gpus, args.tp_size)
        splits.append(split)
        return forward

    time_variants(results, out, apply, inputs, ("patches",), args.warmup, args.repeats)
    for split in splits:
        split.close()
    return results


@dataclass(frozen=True)
class VisionPath:
    """A family's benchmark: its case names, its variants in order, ``run(args, out, device) -> results``, the unit
    its chart counts, and whether its tower can be split (``--tp-gpus``)."""

    cases: tuple[str, ...]
    variants: tuple[str, ...]
    run: Callable[[argparse.Namespace, Path, torch.device], dict]
    unit: str
    tensor_parallel: bool


PATHS = {"qwen2_5_vl": VisionPath(tuple(CASES), VARIANTS, run, "patches", tensor_parallel=True),
         "internvl3": VisionPath(tuple(vision_tiles.CASES), vision_tiles.VARIANTS, vision_tiles.run, "tiles",
                                 tensor_parallel=False)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``argv``, default ``sys.argv[1:]``); ``cases`` and ``variants`` default to all of the
    preset's family (:data:`PATHS`). Exits with a usage error for a case or variant of another family, tensor
    parallel for a family whose tower has no split, or counts out of range."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out",
                        help="folder for vision_bench.json/.png (default results/vision-<date> beside this script)")
    add_preset_argument(parser)
    parser.add_argument("--repeats", type=int, default=10, help="timed forwards per case and variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed forwards after the first")
    all_cases = [case for path in PATHS.values() for case in path.cases]
    parser.add_argument("--cases", nargs="+", choices=all_cases, help="default: all of the preset's family")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS,
                        help="in this order; each adds to the ones before it (default: all of the preset's family)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the dummy weights and pixels")
    parser.add_argument("--tp-gpus", type=int, default=1,
                        help="also the tower split over this many GPUs (backends.runtime.vision.tensor_parallel), after the variants")
    parser.add_argument("--tp-size", type=int, help="GPUs per split tower (default all --tp-gpus): hybrid DP x TP")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be at least 1 and --warmup at least 0")
    family = preset_family(args.preset)
    path = PATHS[family]
    args.cases = args.cases or list(path.cases)
    args.variants = args.variants or list(path.variants)
    for kind, chosen, known in (("case", args.cases, path.cases), ("variant", args.variants, path.variants)):
        other = [name for name in chosen if name not in known]
        if other:
            parser.error(f"{kind} {', '.join(other)} is not one of preset {args.preset}'s: {', '.join(known)}")
    if args.tp_gpus > 1 and not path.tensor_parallel:
        parser.error(f"--tp-gpus: the {family} vision tower has no tensor-parallel split in this benchmark")
    return args


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("vision_bench.py needs a CUDA GPU: torch.cuda.is_available() is False here "
                 f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    out = Path(args.out or Path(__file__).parent / "results" / f"vision-{datetime.date.today().isoformat()}")
    path = PATHS[preset_family(args.preset)]
    results = path.run(args, out, torch.device("cuda", 0))
    plot(results, out / "vision_bench.png", f"{args.preset} vision", path.unit)
    print(f"wrote {write(out, 'vision_bench', results)} and vision_bench.png")


if __name__ == "__main__":
    main()
