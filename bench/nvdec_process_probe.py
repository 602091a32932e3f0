"""Probe (issue 5): does NVDEC decoding in one process stop scaling before the engines do?

    python3 bench/nvdec_process_probe.py VIDEO.mp4        # on a GPU machine with PyNvVideoCodec; $OUT for the JSON

The Qwen2.5-VL sampled frames of VIDEO are cut into P equal parts, one per process (spawned), each decoding its
part with its own `NvdecDecoder` (default sessions per GPU; frames left on the GPU, not patchified) on the GPU
its layout names, after a warm-up that opens the sessions. Wall time is from the first process's start (all
wait at a barrier) to the last one's end. Layouts: 1, 2 and 3 processes on GPU 0; with two GPUs or more also
one process on GPUs 0+1, one process per GPU, and two per GPU. Prints one JSON line per layout and writes
`$OUT/nvdec_process_probe.json` (default /tmp)."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def worker(gpus, part: list[int], path: str, barrier, results, sessions: int | None) -> None:
    """One process: warm up an `NvdecDecoder` on `gpus`, wait for the others, decode `part`, report
    (start, end, frames) in time.time() seconds."""
    import torch

    from flashcodec.nvdec import NvdecDecoder

    decoder = NvdecDecoder(gpus, sessions_per_gpu=sessions, output_device=None)
    for _ in decoder.decode(path, part[:16]):
        pass
    torch.cuda.synchronize()
    barrier.wait()
    start, frames = time.time(), 0
    for _ in decoder.decode(path, part):
        frames += 1
    for gpu in gpus if isinstance(gpus, list) else [gpus]:
        torch.cuda.synchronize(gpu)
    results.put((start, time.time(), frames))
    decoder.close()


def layout_run(layout: list, indices: list[int], path: str, sessions: int | None = None) -> dict:
    """`indices` cut into len(`layout`) parts, part k decoded by a process on GPU(s) `layout[k]`."""
    ctx = mp.get_context("spawn")
    n = len(layout)
    parts = [indices[k * len(indices) // n:(k + 1) * len(indices) // n] for k in range(n)]
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(g, part, path, barrier, results, sessions))
             for g, part in zip(layout, parts)]
    for proc in procs:
        proc.start()
    done = [results.get(timeout=300) for _ in procs]
    for proc in procs:
        proc.join()
    return {"layout": [str(g) for g in layout], "sessions_per_gpu": sessions,
            "wall_s": max(r[1] for r in done) - min(r[0] for r in done), "frames": sum(r[2] for r in done),
            "per_process_s": [r[1] - r[0] for r in done]}


def main() -> None:
    import torch

    from flashcodec.probe import probe_video
    from flashcodec.sampling import plan_video

    try:
        import PyNvVideoCodec  # noqa: F401
    except ImportError:
        sys.exit("needs PyNvVideoCodec (and a CUDA GPU)")
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    path = sys.argv[1]
    indices = list(plan_video(probe_video(path)).frame_indices)
    layouts = {"1proc_gpu0": ([0], None), "2proc_gpu0": ([0, 0], None), "3proc_gpu0_s3": ([0, 0, 0], 3)}
    if torch.cuda.device_count() > 1:
        layouts.update({"1proc_gpus01": ([[0, 1]], None), "2proc_gpu0_gpu1": ([0, 1], None),
                        "4proc_2pergpu": ([0, 0, 1, 1], None)})
    results = {"video": path, "sampled": len(indices)}
    for name, (layout, sessions) in layouts.items():
        results[name] = layout_run(layout, indices, path, sessions)
        print(name, json.dumps(results[name]), flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "nvdec_process_probe.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
