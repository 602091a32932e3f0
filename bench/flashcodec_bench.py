"""FlashCodec benchmark (issue 3): video file -> all sampled frames patchified on the GPU, per decoder.

    python3 bench/flashcodec_bench.py --out DIR                                # on the H200 (NVDEC)
    python3 bench/flashcodec_bench.py --smoke --out /tmp/flashcodec-smoke      # any machine, CPU paths only

Test videos (``bench/video_files.py``): real footage re-encoded (1080p H.264 at 6 Mbit/s, GOP 250, 3 B-frames;
1080p HEVC; 720p H.264) and remuxed to 1, 3 and 10 minutes. Methods: FlashCodec on NVDEC (GOP tasks on all
sessions; `flashcodec_nvdec_2proc`: the same sessions split over this process and a helper process) and
FlashCodec's own CPU path (PyAV GOP-parallel on all host cores, skipping what no sample needs), beside the
baselines (``bench/decode_baselines.py``), which decode every frame up to the last sample: one PyNvVideoCodec
session decoding the sampled indices sequentially, PyAV with FFmpeg's threads on all cores in one process, OpenCV
in one process with its threads on all cores, OpenCV in one process per core on keyframe-aligned parts, and
(smoke only) PyAV sequential. A full run takes about 6 minutes on the H200
host; `--videos` splits it across calls. Every method ends with the Qwen2.5-VL patches of all sampled
frames on the device (`resize_frames` + `normalize` + `patchify_group`), synchronised. Writes
`<out>/flashcodec_bench.json` (device, date, versions, per video and method: seconds, frames/s, peak GPU
memory a run takes and memory the decoder holds between runs (its sessions), NVDEC per-session frames/s, the
decode paths that really ran and every fallback with its reason) and
`<out>/flashcodec_bench.png`; `--decode-only` times decoding alone (`flashcodec_bench_decode_only.*`).
A FlashCodec method whose videos went to another path (NVDEC falling back to the CPU) is not reported under
its name but as `<method>_FELL_BACK_TO_<paths>`, and the run exits with status 1.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import bar_chart, header, write  # noqa: E402
from bench.decode_baselines import (nvdec_one_session, opencv_frames, opencv_processes_frames,  # noqa: E402
                                    pyav_threaded_frames)
from bench.flashcodec_common import (PeakMemory, checked_label, device_memory_used, fallbacks,  # noqa: E402
                                     patchify, session_rates)
from bench.video_files import FULL, SMOKE, build_video  # noqa: E402
from flashcodec.decoders import CpuDecoder, DecodePaths  # noqa: E402
from flashcodec.gop import analyse_bitstream  # noqa: E402
from flashcodec.parallel import ParallelCpuDecoder  # noqa: E402
from flashcodec.probe import probe_video  # noqa: E402
from flashcodec.sampling import plan_video  # noqa: E402

OURS_ON_NVDEC = ("flashcodec_nvdec", "flashcodec_nvdec_2proc")
CPU_BASELINES = ("pyav_threaded", "opencv", "opencv_processes")  # decode every frame up to the last sample
FIXED_PATH = {"opencv": "opencv_cpu", "opencv_processes": "opencv_cpu_processes", "pyav_threaded": "pyav_cpu_threads",
              "nvdec_one_session": "nvdec_simple_decoder"}


def methods(device: torch.device, smoke: bool) -> dict:
    """name -> (make(), frames(decoder, path, indices), warm-up first?) for the methods this machine can run.
    NVDEC sessions are long-lived in a server, so their creation is left out of the timing (a warm-up run).
    PyAV sequential (one core) runs in the smoke test only: on a 10-minute 1080p video it takes minutes."""
    cores = len(os.sched_getaffinity(0))
    found = {"pyav_gop_parallel": (lambda: ParallelCpuDecoder(cores, paths=DecodePaths()),
                                   lambda d, p, i: d.decode(p, i), False)}
    if smoke:
        found["pyav_sequential"] = (lambda: CpuDecoder(paths=DecodePaths()), lambda d, p, i: d.decode(p, i), False)
    found["pyav_threaded"] = (lambda: None, lambda d, p, i: pyav_threaded_frames(p, i, cores), False)
    try:
        import cv2

        cv2.setNumThreads(cores)
        found["opencv"] = (lambda: None, lambda d, p, i: opencv_frames(p, i), False)
        found["opencv_processes"] = (lambda: multiprocessing.get_context("spawn").Pool(cores),
                                     opencv_processes_frames, True)
    except ImportError:
        pass
    if not smoke and device.type == "cuda":
        from flashcodec.nvdec import NvdecDecoder

        gpu = device.index or 0
        def flashcodec_nvdec(processes: int):
            paths = DecodePaths()  # shared with its CPU fallback, so a fallback shows as "cpu"
            return NvdecDecoder(gpu, fallback=CpuDecoder(paths=paths), paths=paths, helper_processes=processes > 1,
                                processes_per_gpu=processes)

        found["flashcodec_nvdec"] = (lambda: flashcodec_nvdec(1), lambda d, p, i: d.decode(p, i), True)
        # the GPU's sessions split over this process and a helper process (NvdecDecoder's processes_per_gpu)
        found["flashcodec_nvdec_2proc"] = (lambda: flashcodec_nvdec(2), lambda d, p, i: d.decode(p, i), True)
        found["nvdec_one_session"] = (dict, lambda d, p, i: nvdec_one_session(d, p, i, gpu), False)
    return found


def run(args) -> dict:
    device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.smoke else torch.device("cpu")
    out, media = Path(args.out), Path(args.media)
    out.mkdir(parents=True, exist_ok=True)
    media.mkdir(parents=True, exist_ok=True)
    videos = {k: v for k, v in (SMOKE if args.smoke else FULL).items() if not args.videos or k in args.videos}
    table = methods(device, args.smoke)
    results = {**header(device, ("av", "cv2", "PyNvVideoCodec")), "decode_only": args.decode_only,
               "load_average_at_start": os.getloadavg(),
               "methods": list(table), "fell_back": False, "videos": {}}
    for name, spec in videos.items():
        path = build_video(media, name, spec)
        info, bmap = probe_video(path), analyse_bitstream(path)
        plan = plan_video(info)
        entry = results["videos"][name] = {
            "codec": info.codec, "size": [info.width, info.height], "frames": info.num_frames,
            "duration_s": info.duration_s, "bytes": path.stat().st_size, "gops": len(bmap.gops),
            "sampled_frames": len(plan.frame_indices), "patch_rows": plan.num_groups * plan.patches_per_group,
            "methods": {}}
        for method, (make, frames, warm) in table.items():
            if args.methods and method not in args.methods:
                continue
            idle = device_memory_used(device)
            decoder = make()
            try:
                paths = getattr(decoder, "paths", None)
                times = []
                for _ in range(args.repeat + warm):
                    with PeakMemory(device) as memory:
                        start = time.perf_counter()
                        target = None if args.decode_only else device
                        rows = patchify(frames(decoder, path, plan.frame_indices), plan, target)
                        times.append(time.perf_counter() - start)
                assert rows == entry["patch_rows"], (method, rows)
                used = paths.snapshot() if paths is not None else {FIXED_PATH[method]: len(times)}
                label = checked_label(method, used)
                times = times[warm:]
                best = min(times)
                entry["methods"][label] = {
                    "seconds": times, "best_s": best, "sampled_frames_per_s": len(plan.frame_indices) / best,
                    "peak_gpu_bytes": memory.peak, "held_gpu_bytes": memory.base - idle, "decode_paths": used,
                    **fallbacks(decoder), **session_rates(decoder)}
                results["fell_back"] |= label != method
                print(f"{name:20s} {label:20s} {best:8.2f} s  paths {used}", flush=True)
            finally:
                if hasattr(decoder, "terminate"):  # a multiprocessing pool
                    decoder.terminate()
                elif hasattr(decoder, "close"):
                    decoder.close()
        entry["ratios"] = {m: ratios(entry["methods"], m) for m in OURS_ON_NVDEC if m in entry["methods"]}
    return results


def ratios(timed: dict, method: str) -> dict:
    """FlashCodec's `method` on NVDEC against the others of the same run (time ratios, higher is faster): one NVDEC
    session, the best CPU baseline (the fastest of `CPU_BASELINES`, named) and FlashCodec's own CPU path."""
    ours = timed.get(method, {}).get("best_s")
    if not ours:
        return {}
    found = {"vs_nvdec_one_session": timed.get("nvdec_one_session", {}).get("best_s")}
    cpu = {m: timed[m]["best_s"] for m in CPU_BASELINES if m in timed}
    if cpu:
        best = min(cpu, key=cpu.get)
        found["best_cpu_baseline"], found["vs_best_cpu_baseline"] = best, cpu[best]
    found["vs_flashcodec_cpu_path"] = timed.get("pyav_gop_parallel", {}).get("best_s")
    return {k: (v / ours if isinstance(v, float) else v) for k, v in found.items() if v is not None}


def plot(results: dict, path: Path) -> None:
    """Seconds per method for each video."""
    rows = [(f"{v} {m}", r["best_s"], f"{r['best_s']:.2f} s")
            for v, e in results["videos"].items() for m, r in e["methods"].items()]
    bar_chart(f"file -> sampled frames patchified, {results['device']} ({results['date']})", rows, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the JSON and the plot")
    parser.add_argument("--media", default="/tmp/flashcodec_bench_media", help="folder for the test videos (kept)")
    parser.add_argument("--smoke", action="store_true", help="a 1-minute 360p video, CPU methods only")
    parser.add_argument("--repeat", type=int, default=1, help="timed runs per method (NVDEC: after a warm-up)")
    parser.add_argument("--videos", nargs="*", help=f"subset of {list(FULL)}")
    parser.add_argument("--methods", nargs="*", help="subset of the method names")
    parser.add_argument("--decode-only", action="store_true", help="time decoding alone (frames not patchified)")
    args = parser.parse_args()
    results = run(args)
    out = Path(args.out)
    stem = "flashcodec_bench" + ("_decode_only" if args.decode_only else "")
    write(out, stem, results)
    plot(results, out / f"{stem}.png")
    if results["fell_back"]:
        print("some FlashCodec method fell back to another decode path: see decode_paths and fallbacks in the JSON")
    for video, entry in results["videos"].items():
        timed = entry["methods"]
        base = "pyav_sequential" if "pyav_sequential" in timed else "nvdec_one_session"
        for method, r in timed.items():
            speedup = f" ({timed[base]['best_s'] / r['best_s']:.2f}x {base})" if base in timed else ""
            print(f"{video}: {method} {r['best_s']:.2f} s{speedup}")
        if entry.get("ratios"):
            print(f"{video}: FlashCodec NVDEC against the others {entry['ratios']}")
    if results["fell_back"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
