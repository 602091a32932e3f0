"""InternVL3's vision side as UnifiedServe runs it (issue 22): ``bench/vision_bench.py --preset internvl3_*``.

The preset's model (``load_model``: dummy bf16 weights seeded by ``--seed``, on cuda:0; the whole model, as
encode_prefill loads it) and its family's vision encoder (``families.internvl3.InternVLVision``: InternViT, the CLS
token dropped, pixel shuffle 0.5, the MLP projector; transformers' ``get_image_features``), fed through the family's
``encode_batch``, which ``ModelRunner.encode_many`` calls on one GPU. The burst: 16 images of 1792x1344 px, each
planned by flashcodec's InternVL3 family at its default most tiles (``InternVL3Config.max_tiles`` 12: a 4x3 grid)
plus the thumbnail: 13 tiles of 3x448x448 an image, 208 tiles, 212,992 patches, 53,248 visual tokens. Cases:

* ``burst_16x13_tiles``: the 16 images in one ``encode_batch`` call (one forward of 208 tiles);
* ``burst_16x13_tiles_in_steps``: the same tiles as encode_prefill gets them, a tile an item (``grid_thw``
  (1, 32, 32)), as many whole tiles a call as the family's default encode budget holds (its ``Family.budgets``:
  5,120 patches, 5 tiles; 42 calls). ``orchestrator.budget_policy`` may scale that budget per step.

Variants: ``transformers_sdpa``: the encoder as loaded (transformers' modules, SDPA attention); ``compiled``: + the
family's ``prepare_vision`` and ``compile_vision`` (``torch.compile(dynamic=True)`` of each InternViT layer and of
the projector), as ``ModelRunner`` prepares it on CUDA: the served path. Each case's first forward is timed on the
host (the compiled variant's includes compilation), then ``--warmup`` more, then ``--repeats`` with CUDA events
(``bench.vision_common``). MFU against 790 TFLOP/s with the FLOPs of :func:`tile_flops`.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from backends.runtime.families.base import VisionItem
from backends.runtime.families.registry import family_for
from backends.runtime.loader import ModelSpec, load_model
from bench.common import header
from bench.vision_common import BASELINE, PEAK_FLOPS, time_variants
from flashcodec.families import family as media_family
from flashcodec.families.internvl3 import InternVL3, TiledImagePlan
from flashcodec.probe import ImageInfo

IMAGES = 16
IMAGE_PX = (1792, 1344)  # width, height: 4x3 tiles of 448, the most a default InternVL3 plan cuts
CASES = ("burst_16x13_tiles", "burst_16x13_tiles_in_steps")
VARIANTS = (BASELINE, "compiled")


def burst_plan() -> TiledImagePlan:
    """The tiles of one burst image: flashcodec's InternVL3 plan with the family's default settings (12 tiles in a
    4x3 grid and the thumbnail: ``grid_thw`` (13, 32, 32))."""
    return InternVL3().plan_image(ImageInfo(*IMAGE_PX, "RGB", "PNG"))


def tile_flops(config, tiles: int) -> dict[str, int]:
    """Matmul FLOPs of encoding ``tiles`` square tiles (one multiply-add = 2 FLOPs), by part, from an
    ``InternVLConfig``.

    Per tile: P = (image_size / patch_size)**2 patches (1024 for 448 / 14) and N = P + 1 tokens (the CLS token);
    InternViT hidden D, MLP width I, L layers, C channels, patch p; text hidden T; pixel shuffle ``downsample_ratio``
    r (0.5): R = P * r**2 rows (256) of width D / r**2 (4D) into the projector:
    * patch embed: the Conv2d whose kernel equals its stride is a linear C*p*p -> D on P patches: ``2*P*C*p*p*D``;
    * per layer: q, k, v projections ``2*N*D*3D``, output projection ``2*N*D*D``, MLP (fc1, fc2) ``2*N*2*D*I``,
      attention over the tile's N tokens ``4*N*N*D`` (QK^T and PV, each ``2*N*N*D`` summed over heads);
    * pixel shuffle: a reshape, no FLOPs; projector (linear_1, linear_2): ``2*R*(D/r**2*T + T*T)``.
    Norms (incl. the q/k norms), layer scale, GELU, softmax: not counted (no matmul FLOPs). InternVL3-38B
    (D 3200, I 12800, L 45, T 5120): 11.99 TFLOP a tile.
    """
    vision = config.vision_config
    d, inter, layers = vision.hidden_size, vision.intermediate_size, vision.num_hidden_layers
    patch = vision.patch_size[0]
    patches = (vision.image_size[0] // patch) ** 2
    tokens = patches + 1
    per_row = round(1 / config.downsample_ratio) ** 2  # patches folded into one projector row
    rows, text = patches // per_row, config.text_config.hidden_size
    parts = {
        "patch_embed": 2 * patches * vision.num_channels * patch * patch * d,
        "qkv": layers * 2 * tokens * d * 3 * d,
        "proj": layers * 2 * tokens * d * d,
        "mlp": layers * 2 * tokens * 2 * d * inter,
        "attention": layers * 4 * tokens * tokens * d,
        "projector": 2 * rows * (per_row * d * text + text * text),
    }
    parts = {name: tiles * flops for name, flops in parts.items()}
    parts["total"] = sum(parts.values())
    return parts


def burst_items(plan: TiledImagePlan, device: torch.device, dtype: torch.dtype, seed: int, images: int = IMAGES
                ) -> list[VisionItem]:
    """``images`` items of random tiles ``[tiles, 3, 448, 448]`` in ``dtype`` on ``device`` with the plan's
    ``grid_thw``."""
    generator = torch.Generator(device).manual_seed(seed)
    shape = (plan.num_groups, 3, plan.tile_size, plan.tile_size)
    return [(torch.randn(shape, device=device, generator=generator).to(dtype), plan.grid_thw) for _ in range(images)]


def budget_steps(items: list[VisionItem], budget: int) -> list[list[VisionItem]]:
    """``items`` cut into one item a tile (``grid_thw`` (1, h, w)), then into calls of as many whole tiles as
    ``budget`` patches hold (at least one)."""
    tiles = [(pixels[k:k + 1], (1, h, w)) for pixels, (t, h, w) in items for k in range(t)]
    per_call = max(1, budget // (tiles[0][1][1] * tiles[0][1][2]))
    return [tiles[k:k + per_call] for k in range(0, len(tiles), per_call)]


def forwards(family, encoder: torch.nn.Module):
    """(one call, calls by steps): each returns the merged embeddings of all its items, concatenated
    (``[tiles * 256, text hidden]``)."""

    def one_call(items: list[VisionItem]) -> torch.Tensor:
        return torch.cat(family.encode_batch(encoder, items))

    def in_steps(steps: list[list[VisionItem]]) -> torch.Tensor:
        return torch.cat([embeds for step in steps for embeds in family.encode_batch(encoder, step)])

    return one_call, in_steps


def run(args: argparse.Namespace, out: Path, device: torch.device) -> dict:
    """The cases and variants of the module docstring for ``args.preset``, written to ``out`` as they run."""
    model, _ = load_model(ModelSpec(preset=args.preset, dtype="bfloat16", seed=args.seed, device=str(device)))
    family = family_for(model.config)
    encoder = family.vision_encoder(model)
    plan = burst_plan()
    items = burst_items(plan, device, model.dtype, args.seed)
    budget = media_family(family.name).budgets.encode
    steps = budget_steps(items, budget)
    one_call, in_steps = forwards(family, encoder)
    tiles = sum(grid[0] for _, grid in items)
    results = header(device)
    results["versions"]["cuda"] = torch.version.cuda
    results.update(preset=args.preset, peak_flops=PEAK_FLOPS, dtype="bfloat16", warmup=args.warmup,
                   repeats=args.repeats, baseline=BASELINE, variants=list(args.variants), cases={},
                   image_px=list(IMAGE_PX), tiles_per_image=plan.num_groups, encode_budget_patches=budget)
    # a case's input: the call that encodes it and its argument (the variant changes the encoder both share)
    calls = {"burst_16x13_tiles": (one_call, items), "burst_16x13_tiles_in_steps": (in_steps, steps)}
    inputs = {case: calls[case] for case in args.cases}
    for case in inputs:
        results["cases"][case] = {"images": len(items), "tiles": tiles, "patches": tiles * plan.patches_per_group,
                                  "calls": 1 if case == "burst_16x13_tiles" else len(steps),
                                  "flops": tile_flops(model.config, tiles)}

    def apply(name: str):
        if name == "compiled":
            family.prepare_vision(encoder)
            family.compile_vision(encoder)
        return lambda call, argument: call(argument)

    time_variants(results, out, apply, inputs, ("tiles", "patches"), args.warmup, args.repeats)
    return results
