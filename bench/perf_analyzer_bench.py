"""perf_analyzer itself against the served model: the input files ``client.perf_analyzer.make_inputs`` writes
(text, one image, a video; streaming), the command lines of client/perf_analyzer/README.md.

    python3 bench/perf_analyzer_bench.py --out DIR [--perf-analyzer PATH] [--smoke]

The server is ``backends.triton.launcher.TritonServer`` on free ports serving the serve bench's setup
(``bench/serve_bench.py``: the 7B preset in bf16, or with ``--smoke`` the tiny default model). perf_analyzer runs
each input file at concurrency 1 and 4 (``--streaming``, count windows) and exports every request's response
times, from which TTFT and TBT are computed as the README says. Writes ``perf_analyzer_bench.json`` and each
run's ``summary_<input>.csv`` to DIR. perf_analyzer is the ``perf-analyzer`` wheel's binary (it needs glibc 2.38:
the H200 machine, ``bench/device_run.sh perf-analyzer``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import header, write  # noqa: E402
from bench.serve_bench import FULL_SETUP, SMOKE_SETUP, TEXT_PROMPT, build_media  # noqa: E402
from bench.video_files import build_video  # noqa: E402
from backends.triton.launcher import TritonServer  # noqa: E402
from backends.triton.ports import ServerPorts  # noqa: E402
from backends.triton.repository import parse_overrides, repository_with  # noqa: E402
from client.perf_analyzer.make_inputs import make_input_data  # noqa: E402

CONCURRENCY = "1:4:3"  # 1 and 4 requests in flight


def input_files(media: Path, setup, folder: Path) -> dict[str, Path]:
    """One perf_analyzer input file per kind: text, one image (bytes), one 20-second clip of the serve bench's video
    spec (a path the server reads: a 3-minute video takes most of a minute per request)."""
    _, images = build_media(media, setup)
    codec, width, height, bit_rate, preset, _ = setup.video
    video = build_video(media, f"bunny_{height}p_20s", (codec, width, height, bit_rate, preset, 1 / 3))
    sampling = {"temperature": 0, "ignore_eos": True}
    data = {
        "text": make_input_data(TEXT_PROMPT, sampling={**sampling, "max_tokens": setup.text_tokens}),
        "image": make_input_data("Describe what you see in detail.", images=[images[0].read_bytes()],
                                 sampling={**sampling, "max_tokens": setup.image_tokens}),
        "video": make_input_data("Describe what you see in detail.", video_urls=[str(video)],
                                 sampling={**sampling, "max_tokens": setup.video_tokens}),
    }
    files = {}
    for name, content in data.items():
        files[name] = folder / f"inputs_{name}.json"
        files[name].write_text(json.dumps(content))
    return files


def timings(profile: Path) -> list[dict]:
    """Per concurrency: requests, TTFT and TBT (ms) from perf_analyzer's profile export (ns timestamps); the last
    response of a request is the empty final one when it has no more tokens than responses-1."""
    out = []
    # errors="replace": the export holds each response's text, and a dummy model's text need not be UTF-8
    for experiment in json.loads(profile.read_bytes().decode(errors="replace"))["experiments"]:
        reqs = [r for r in experiment["requests"] if r.get("response_timestamps")]
        ttft = [(r["response_timestamps"][0] - r["timestamp"]) / 1e6 for r in reqs]
        tbt = [(b - a) / 1e6 for r in reqs for a, b in zip(r["response_timestamps"], r["response_timestamps"][1:])]
        out.append({"experiment": experiment["experiment"], "requests": len(reqs),
                    "ttft_ms_p50": statistics.median(ttft) if ttft else None,
                    "ttft_ms_max": max(ttft) if ttft else None,
                    "tbt_ms_mean": statistics.fmean(tbt) if tbt else None,
                    "tbt_ms_p50": statistics.median(tbt) if tbt else None,
                    "responses_per_request": statistics.fmean(len(r["response_timestamps"]) for r in reqs)
                    if reqs else None})
    return out


def perf_analyzer(binary: str, grpc: str, inputs: Path, out: Path, name: str, count: int, stability: int) -> dict:
    """One perf_analyzer run over ``inputs`` (``stability``: perf_analyzer's --stability-percentage); its exit code,
    summary CSV, timings and the tail of its output."""
    profile, summary = out / f"profile_{name}.json", out / f"summary_{name}.csv"
    command = [binary, "-m", "orchestrator", "-i", "grpc", "-u", grpc, "--streaming", "--input-data", str(inputs),
               "--concurrency-range", CONCURRENCY, "--measurement-mode", "count_windows",
               "--measurement-request-count", str(count), "--stability-percentage", str(stability), "--max-trials", "3",
               "--profile-export-file", str(profile), "-f", str(summary)]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    result = {"command": " ".join(command), "returncode": done.returncode, "seconds": time.perf_counter() - started,
              "output_tail": (done.stdout + done.stderr)[-4000:]}
    if profile.exists():
        result["timings"] = timings(profile)
        profile.unlink()  # large (every response's time): the timings above are what is kept
    if summary.exists():
        result["summary_csv"] = summary.read_text()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the JSON, the CSVs and the server log")
    parser.add_argument("--media", default="/tmp/serve_bench_media", help="folder for the video and images (kept)")
    parser.add_argument("--perf-analyzer", default=shutil.which("perf_analyzer") or "perf_analyzer")
    parser.add_argument("--smoke", action="store_true", help="the tiny default model and small media")
    parser.add_argument("--inputs", nargs="*", default=["text", "image", "video"], help="which input files to run")
    args = parser.parse_args()
    setup = SMOKE_SETUP if args.smoke else FULL_SETUP
    out, media = Path(args.out), Path(args.media)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    results = {**header(device, ("tritonclient",)), "smoke": args.smoke, "server_overrides": list(setup.overrides),
               "perf_analyzer": args.perf_analyzer, "runs": {}}
    version = subprocess.run([args.perf_analyzer, "--version"], capture_output=True, text=True)
    results["perf_analyzer_version"] = (version.stdout + version.stderr).strip()[-200:]
    ports = ServerPorts.unused()
    with tempfile.TemporaryDirectory(prefix="perf-analyzer-bench-") as work:
        files = input_files(media, setup, Path(work))
        repository = repository_with(Path(work) / "repository", parse_overrides(list(setup.overrides)))
        server = TritonServer(repository, ports, ready_timeout_s=900, log_path=out / "perf_analyzer_server.log",
                              extra_env={"UNIFIEDSERVE_MEDIA_DIRS": str(media.resolve())})
        started = time.perf_counter()
        with server:
            results["server_ready_s"] = time.perf_counter() - started
            print(f"server ready in {results['server_ready_s']:.0f} s", flush=True)
            # a video window is 4 requests of seconds each, whose first pays first-use costs: perf_analyzer never
            # calls three such windows stable (2026-12-01, 20-s clip), so they are measured as they come
            for name, count, stability in (("text", 16, 50), ("image", 16, 50), ("video", 4, 1000)):
                if name not in args.inputs:
                    continue
                run = results["runs"][name] = perf_analyzer(args.perf_analyzer, f"127.0.0.1:{ports.grpc}",
                                                            files[name], out, name, count, stability)
                print(name, "exit", run["returncode"], json.dumps(run.get("timings")), flush=True)
    print("wrote", write(out, "perf_analyzer_bench", results))
    sys.exit(0 if all(r["returncode"] == 0 for r in results["runs"].values()) else 1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
