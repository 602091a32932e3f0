"""What the vision tower's CUDA graphs save per encode call (``backends.runtime.vision.graphs``, issue 20's images).

    python3 bench/vision_graphs_bench.py --out DIR [--repeats 10]     # needs a CUDA GPU

The 7B architecture's tower (dummy bf16 weights, seeded) prepared and compiled as the encode_prefill stage runs it.
Per case, the items of one encode call: the eager call (``Qwen2_5_VL.encode_batch``, all items in one forward, as the
stage runs items without a graph) and the graphed one (``VisionGraphs.encode_many``: each item replays its grid's
graph), each timed as the step sees it: host clock from the call to the device having run it (``wall_ms``), median of
``--repeats`` calls after warm-up, and the same calls' device time (CUDA events, ``device_ms``). Cases: one image of
640x360, 1280x720 and 1920x1080 (their smart_resize grids), two 1280x720 images (a step of the 16-image burst), two
frames of a 448x252 video group. Also the capture's host time per grid (``capture_s``) and the memory the graphs
reserved (``graph_pool_mib``). Writes ``<out>/vision_graphs_bench.json``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import Qwen2_5_VLVisionConfig  # noqa: E402
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel  # noqa: E402

from backends.runtime.families.qwen2_5_vl import Qwen2_5_VL  # noqa: E402
from backends.runtime.presets import PRESETS  # noqa: E402
from backends.runtime.vision.graphs import GraphChoice, VisionGraphs  # noqa: E402
from bench.common import cuda_times_ms, header, write  # noqa: E402

CASES = {  # name: grids (t, h, w) of one call's items
    "image_640x360": [(1, 26, 46)],
    "image_1280x720": [(1, 52, 92)],
    "image_1920x1080": [(1, 78, 138)],
    "two_1280x720": [(1, 52, 92), (1, 52, 92)],
    "video_group_448x252": [(2, 18, 32)],
}


def wall_ms(call, repeats: int) -> list[float]:
    """Host milliseconds from ``call()`` to the device having run it, ``repeats`` times."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    device = torch.device("cuda:0")
    family = Qwen2_5_VL()
    config = Qwen2_5_VLVisionConfig(**PRESETS["qwen2_5_vl_7b"]["vision_config"])
    torch.manual_seed(0)
    tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(config, dtype=torch.bfloat16).to(device).eval()
    family.prepare_vision(tower)
    family.compile_vision(tower)
    graphs = VisionGraphs(tower, GraphChoice(max_patches=10 ** 6, max_graphs=64, capture_after=1,
                                             max_total_patches=10 ** 7))
    results = {**header(device), "repeats": args.repeats, "cases": {}}
    generator = torch.Generator(device=device).manual_seed(1)
    for name, grids in CASES.items():
        items = [(torch.randn(t * h * w, 1176, generator=generator, device=device), (t, h, w)) for t, h, w in grids]

        def eager():
            with torch.no_grad():
                return family.encode_batch(tower, items)

        def graphed():
            return graphs.encode_many(items, _never_eager)

        for _ in range(3):
            eager()  # compiles the blocks at the first case
        reserved = torch.cuda.memory_reserved(device)
        start = time.perf_counter()
        graphed()  # captures each new grid
        torch.cuda.synchronize()
        capture_s = time.perf_counter() - start
        row = {"grids": grids, "patches": sum(t * h * w for t, h, w in grids), "capture_s": capture_s,
               "graph_pool_mib": (torch.cuda.memory_reserved(device) - reserved) / 2 ** 20}
        for label, call in (("eager", eager), ("graphs", graphed)):
            call()
            row[f"{label}_wall_ms"] = statistics.median(wall_ms(call, args.repeats))
            row[f"{label}_device_ms"] = statistics.median(cuda_times_ms(call, args.repeats, warmup=1))
        want, got = eager(), graphed()
        row["max_abs_difference"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
        row["wall_speedup"] = row["eager_wall_ms"] / row["graphs_wall_ms"]
        results["cases"][name] = row
        print(f"{name}: {row['patches']} patches, eager {row['eager_wall_ms']:.1f} ms wall "
              f"({row['eager_device_ms']:.1f} device), graphs {row['graphs_wall_ms']:.1f} ms wall "
              f"({row['graphs_device_ms']:.1f} device), capture {capture_s:.2f} s, "
              f"+{row['graph_pool_mib']:.0f} MiB, max |diff| {row['max_abs_difference']:.3g}", flush=True)
        write(args.out, "vision_graphs_bench", results)


def _never_eager(items):
    raise AssertionError(f"items ran eagerly: {[grid for _, grid in items]}")


if __name__ == "__main__":
    main()
