"""FlashCodec on several GPUs (issue 5): latency of one long video decoded and patchified on 1, 2, 4, 8 GPUs.

    python3 bench/flashcodec_multi_gpu_bench.py --out DIR   # >= 1 GPU

One 20-minute 1080p H.264 video (6 Mbit/s, GOP 250, 3 B-frames: `video_files.build_video`, real footage
remuxed) is decoded by `NvdecDecoder` with its GOP tasks on the NVDEC sessions of the first N GPUs (one shared
task queue), its Qwen2.5-VL sampled frames (fps 2, at most 768) arriving in order on GPU 0, where they are
resized, normalised and patchified (`flashcodec_common.patchify`), synchronised. N runs over 1, 2, 4, 8 and the
machine's GPU count, up to that count; each N > 1 twice: the GPUs past the first in helper processes
(`helper_processes`, what the server does) and in threads of this process. Sessions are long-lived in a server, so each N has a warm-up run that opens
them, left out of the timing. Parallel efficiency = t1 / (N * tN). Writes `<out>/flashcodec_multi_gpu_bench.json`
(device, date, versions; per N: seconds, frames/s, efficiency, GOP tasks and busy seconds per GPU, peak memory
on GPU 0, decode paths and fallbacks) and `.png`. A run where NVDEC fell back to the CPU is reported as
`<N>_gpus_FELL_BACK_TO_<paths>` and the script exits with status 1. Needs CUDA and PyNvVideoCodec: without
them it says so and exits with status 2.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import bar_chart, header, write  # noqa: E402
from bench.flashcodec_common import PeakMemory, checked_label, fallbacks, patchify  # noqa: E402
from bench.video_files import build_video  # noqa: E402
from flashcodec.decoders import CpuDecoder, DecodePaths  # noqa: E402
from flashcodec.gop import analyse_bitstream  # noqa: E402
from flashcodec.probe import probe_video  # noqa: E402
from flashcodec.sampling import plan_video  # noqa: E402

GPU_COUNTS = (1, 2, 4, 8)
STEM = "flashcodec_multi_gpu_bench"


def video_spec(minutes: float) -> tuple[str, tuple]:
    """`build_video`'s name and spec: 1080p H.264 at 6 Mbit/s, as `video_files.FULL`'s 1080p videos."""
    return f"h264_1080p_{minutes:g}min", ("libx264", 1920, 1080, 6_000_000, "medium", minutes)


def gpu_counts(available: int, asked: list[int] | None) -> list[int]:
    """The N to run: `asked`, else 1, 2, 4, 8 and `available`; never more than `available`."""
    wanted = asked or [*GPU_COUNTS, available]
    return sorted({n for n in wanted if 1 <= n <= available})


def per_gpu(decoder, field: str) -> dict[int, float]:
    totals: dict[int, float] = {}
    for stats in decoder.session_stats():
        totals[stats.gpu] = totals.get(stats.gpu, 0) + getattr(stats, field)
    return dict(sorted(totals.items()))


def run_on(gpus: int, path: Path, plan, args, helper_processes: bool) -> dict:
    """Decode (and patchify) `plan`'s frames of `path` on GPUs 0 .. gpus - 1, output on GPU 0; GPUs past the
    first in helper processes or in threads of this one."""
    from flashcodec.nvdec import NvdecDecoder

    paths = DecodePaths()  # shared with the CPU fallback, so that a fallback shows as "cpu"
    decoder = NvdecDecoder(list(range(gpus)), args.sessions_per_gpu, fallback=CpuDecoder(paths=paths), paths=paths,
                           helper_processes=helper_processes,
                           processes_per_gpu=args.processes_per_gpu if helper_processes else 1)
    device, target = torch.device("cuda", 0), None if args.decode_only else torch.device("cuda", 0)
    try:
        patchify(decoder.decode(path, plan.frame_indices), plan, target)  # warm-up: every session opened
        tasks, busy = per_gpu(decoder, "tasks"), per_gpu(decoder, "busy_s")
        times = []
        for _ in range(args.repeat):
            with PeakMemory(device) as memory:
                start = time.perf_counter()
                rows = patchify(decoder.decode(path, plan.frame_indices), plan, target)
                times.append(time.perf_counter() - start)
            assert rows == plan.num_groups * plan.patches_per_group, rows
        best, used = min(times), paths.snapshot()
        return {"gpus": gpus, "helper_processes": helper_processes and (gpus > 1 or args.processes_per_gpu > 1),
                "processes_per_gpu": args.processes_per_gpu if helper_processes else 1,
                "label": checked_label("flashcodec_nvdec", used), "sessions": decoder.sessions,
                "seconds": times, "best_s": best, "sampled_frames_per_s": len(plan.frame_indices) / best,
                "peak_gpu0_bytes": memory.peak, "decode_paths": used,
                "tasks_per_gpu": {g: n - tasks.get(g, 0) for g, n in per_gpu(decoder, "tasks").items()},
                "busy_s_per_gpu": {g: s - busy.get(g, 0) for g, s in per_gpu(decoder, "busy_s").items()},
                **fallbacks(decoder)}
    finally:
        decoder.close()


def run(args) -> dict:
    out, media = Path(args.out), Path(args.media)
    media.mkdir(parents=True, exist_ok=True)
    name, spec = video_spec(args.minutes)
    path = build_video(media, name, spec)
    info, bmap = probe_video(path), analyse_bitstream(path)
    plan = plan_video(info)
    available = torch.cuda.device_count()
    results = {**header(torch.device("cuda", 0), ("av", "PyNvVideoCodec")), "decode_only": args.decode_only,
               "gpu_names": [torch.cuda.get_device_name(g) for g in range(available)],
               "video": {"name": name, "codec": info.codec, "size": [info.width, info.height],
                         "frames": info.num_frames, "duration_s": info.duration_s, "bytes": path.stat().st_size,
                         "gops": len(bmap.gops), "sampled_frames": len(plan.frame_indices),
                         "patch_rows": plan.num_groups * plan.patches_per_group},
               "fell_back": False, "runs": []}
    for gpus in gpu_counts(available, args.gpus):
        for helpers in (True, False) if gpus > 1 else (False,):
            entry = run_on(gpus, path, plan, args, helpers)
            results["runs"].append(entry)
            results["fell_back"] |= entry["label"] != "flashcodec_nvdec"
            print(f"{gpus} GPU(s){' (helper processes)' if helpers else ''}: {entry['best_s']:.2f} s, tasks per GPU "
                  f"{entry['tasks_per_gpu']}, paths {entry['decode_paths']}", flush=True)
    t1 = next((r["best_s"] for r in results["runs"] if r["gpus"] == 1), None)
    for entry in results["runs"]:
        entry["parallel_efficiency"] = t1 / (entry["gpus"] * entry["best_s"]) if t1 else None
        entry["speedup"] = t1 / entry["best_s"] if t1 else None
    write(out, STEM, results)
    plot(results, out / f"{STEM}.png")
    return results


def plot(results: dict, path: Path) -> None:
    """Seconds per GPU count, with the parallel efficiency."""
    rows = []
    for r in results["runs"]:
        label = f"{r['gpus']} GPU(s)" + (f" {r['processes_per_gpu']} proc/GPU" if r["helper_processes"] else "")
        label += "" if r["label"] == "flashcodec_nvdec" else f" {r['label']}"
        efficiency = f", efficiency {r['parallel_efficiency']:.2f}" if r["parallel_efficiency"] is not None else ""
        rows.append((label, r["best_s"], f"{r['best_s']:.2f} s{efficiency}"))
    what = "decoded" if results["decode_only"] else "decoded + patchified"
    bar_chart(f"{results['video']['name']} {what}, {results['device']} ({results['date']})", rows, path)


def check_machine() -> None:
    """Exit (status 2) with the reason when this machine cannot run the benchmark."""
    why = "" if torch.cuda.is_available() else "a CUDA GPU with NVDEC, and torch sees none here"
    if not why:
        try:
            import PyNvVideoCodec  # noqa: F401
        except Exception as exc:  # ImportError, or its CUDA libraries failing to load
            why = f"PyNvVideoCodec ({type(exc).__name__}: {exc})"
    if why:
        print(f"{STEM}: needs {why}: nothing was run", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the JSON and the plot")
    parser.add_argument("--media", default="/tmp/flashcodec_bench_media", help="folder for the test video (kept)")
    parser.add_argument("--minutes", type=float, default=20, help="length of the video (default 20)")
    parser.add_argument("--gpus", type=int, nargs="*", help=f"GPU counts to run (default {GPU_COUNTS} and all)")
    parser.add_argument("--sessions-per-gpu", type=int, help="NVDEC sessions per GPU (default: its engine count)")
    parser.add_argument("--processes-per-gpu", type=int, default=1,
                        help="with helper processes: each GPU's sessions split over this many processes (default 1)")
    parser.add_argument("--repeat", type=int, default=2, help="timed runs per GPU count, after a warm-up")
    parser.add_argument("--decode-only", action="store_true", help="time decoding alone (frames not patchified)")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    check_machine()
    results = run(args)
    for r in results["runs"]:
        helpers = f" helper processes ({r['processes_per_gpu']} per GPU)" if r["helper_processes"] else ""
        print(f"{r['gpus']} GPU(s){helpers}: {r['best_s']:.2f} s, speedup {r['speedup'] or 0:.2f}x, "
              f"parallel efficiency {r['parallel_efficiency'] or 0:.2f}")
    if results["fell_back"]:
        print("NVDEC fell back to another decode path: see decode_paths and fallbacks in the JSON", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
