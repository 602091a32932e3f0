"""The peer benchmark (issue 19, item 1): UnifiedServe and vLLM 0.26 on the same machine, the same weightless
checkpoint (Qwen2.5-VL-7B; ``--model internvl3_38b`` or ``internvl3_8b``: issue 22's InternVL3, ``bench.peer.models``),
the same inputs and the same load generator, one system after the other; writes
``<out>/summary.json`` (issue 19's Targets keys, with issue 20's short-request figures), ``<out>/report.json``
(request counts, errors, prompt tokens of both systems side by side, goodput attainment tables, the load
generator's cross-check) and the raw records, ``<out>/raw/<system>/<scenario>.json``.

    python3 -m bench.peer.run all                                  # everything, in one process
    python3 -m bench.peer.run all --smoke --systems unifiedserve --scenarios text_c1 images16   # CPU, tiny model

A device call lasts at most 10 minutes, so on the H200 the same work runs as steps, the servers living on between
calls (each is started in a session of its own; ``<work>/state`` says where it is):

    python3 -m bench.peer.run prepare                              # checkpoint + media in --work
    python3 -m bench.peer.run start --systems unifiedserve         # start, wait until ready, warm up
    python3 -m bench.peer.run scenarios --systems unifiedserve --scenarios video mixed_video
    python3 -m bench.peer.run scenarios --systems unifiedserve --scenarios mixed_images text_c1 text_c32 images16
    python3 -m bench.peer.run stop --systems unifiedserve
    ... the same for vllm (and ``--scenarios crosscheck`` against it: ``vllm bench serve`` beside ours) ...
    python3 -m bench.peer.run summary

The same steps serve InternVL3 with ``--model`` on every call: ``prepare`` writes its checkpoint, ``start`` records it
in the server's state, ``scenarios`` refuses a server of another model (bench/peer/README.md).

Issue 21's cache scenarios, in a results folder of their own (``--out``), both systems with their caches on:

    python3 -m bench.peer.run start --systems unifiedserve --caches
    python3 -m bench.peer.run scenarios --systems unifiedserve --scenarios followup multiturn
    python3 -m bench.peer.run stop --systems unifiedserve
    python3 -m bench.peer.run start --systems vllm --caches
    ... scenarios and stop as for unifiedserve (both with the same --clips, --clip-seconds, --questions, --streams)

Scenarios (``bench/peer/scenarios.py``): video, mixed_video, mixed_images, text_c1, text_c32, images16;
``goodput_<long_video|video|images>@unloaded`` and ``@<rate>`` (requests/s), or ``goodput_<workload>`` for the
unloaded pass and every default rate (``goodput_multiturn``: sessions/s, with the caches on); ``crosscheck``
(``bench/peer/crosscheck.py``); followup, multiturn; text_c32_structured (structured outputs' cost).
Every scenario's raw JSON holds the server's command line and its prefix-cache counters' increase
(``bench/peer/prefix_cache.py``; None where it has none). bench/peer/README.md gives the device-call sequence.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from bench.common import header, write  # noqa: E402
from bench.serve_bench import decode_overhead, distribution, read_metrics  # noqa: E402
from bench.peer import client_loop, crosscheck, prefix_cache, process_cpu, py_spy, scenarios, servers  # noqa: E402
from bench.peer.checkpoint import write_checkpoint  # noqa: E402
from bench.peer.figures import figures_line  # noqa: E402
from bench.peer.gpu_busy import GpuSampler  # noqa: E402
from bench.peer.load import Target, closed_loop, open_loop  # noqa: E402
from bench.peer.models import DEFAULT, MODELS  # noqa: E402
from bench.peer.summary import raw_stem, write_summary  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
METRICS_SETTLE_S = 2.5  # the orchestrator sends its counters once a second: wait for a scenario's last ones


def paths(args: argparse.Namespace) -> dict[str, Path]:
    work = Path(args.work).resolve()  # the servers are given absolute media folders
    return {"checkpoint": work / MODELS[args.model].checkpoint_dir, "media": work / "media",
            "state": work / "state", "out": Path(args.out)}


def prepare(args: argparse.Namespace) -> scenarios.Inputs:
    """The checkpoint directory (not for ``--smoke``: the tiny model has its own tokenizer) and the media, in
    ``--work`` (kept: a second call reuses them); the cache scenarios' media only when ``--scenarios`` names one."""
    p = paths(args)
    if not args.smoke and not (p["checkpoint"] / "config.json").exists():
        write_checkpoint(p["checkpoint"], MODELS[args.model].preset)
    names = set(args.scenarios or ())
    cache_media = bool({"followup", "multiturn"} & names)
    goodput_sessions = (args.requests or scenarios.GOODPUT_REQUESTS["multiturn"]) \
        if any(n.startswith("goodput_multiturn") for n in names) else 0
    inputs = scenarios.build_inputs(p["media"], args.smoke, args.clips, args.clip_seconds, cache_media,
                                    goodput_sessions)
    if args.text_tokens:  # e.g. the smoke's text scenarios at the full setup's 256 tokens, for the CPU machine
        inputs = replace(inputs, setup=replace(inputs.setup, text_tokens=args.text_tokens))
    print(f"media {p['media']}" + ("" if args.smoke else f", checkpoint {p['checkpoint']}"), flush=True)
    return inputs


def server_version(system: str, url: str, repo: Path = REPO) -> str | None:
    """vLLM's ``/version``; for UnifiedServe the commit of the tree in ``repo``, with ``+modified`` where tracked
    files outside ``bench/results`` differ from it (a device machine's copy of the tree may be newer than its copy
    of the history; results unpacked between calls are no change to the server); None outside a git checkout or
    without git."""
    if system == "vllm":
        with urllib.request.urlopen(f"{url}/version", timeout=10) as response:
            return json.loads(response.read())["version"]
    git = ["git", "-C", str(repo)]
    try:
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        changed = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no", "--", ".",
                                  ":(exclude)bench/results"], capture_output=True, text=True)
    except FileNotFoundError:
        return None
    if commit.returncode or not commit.stdout.strip():
        return None
    return commit.stdout.strip() + ("+modified" if changed.returncode or changed.stdout.strip() else "")


def start(args: argparse.Namespace, system: str) -> None:
    """Start ``system`` serving ``--model``, wait until its API answers, record its version and the model, send the
    warm-up requests."""
    p = paths(args)
    argv, env = servers.command(system, p["checkpoint"], p["media"], args.smoke, args.server_args, args.caches,
                                MODELS[args.model], servers.gpu_memory_gib())
    pythonpath = args.vllm_site if system == "vllm" else None
    state = servers.start(system, argv, env, p["state"], p["out"] / "logs" / f"{system}.log", pythonpath,
                          args.ready_timeout)
    state["version"] = server_version(system, state["url"])
    state["peer_model"] = args.model
    (p["state"] / f"{system}.json").write_text(json.dumps(state, indent=1))
    print(f"{system} ready at {state['url']} (model {state['model']}, version {state['version']})", flush=True)
    target = target_of(args, system, state)
    inputs = prepare(args)
    warm = asyncio.run(closed_loop(target, 1, scenarios.warmup_requests(inputs)))
    warm += asyncio.run(open_loop(target, scenarios.warmup_burst(inputs)))
    for record in warm:
        if record.error:
            print(f"warm-up {record.kind} request failed: {record.error}", flush=True)


def target_of(args: argparse.Namespace, system: str, state: dict) -> Target:
    """The running server of ``state`` (``servers.start``'s record) as the load generator's target, with
    ``--model``'s video kwargs. Raises SystemExit when the server serves another model (a record without
    ``peer_model`` served the default one)."""
    served = state.get("peer_model", DEFAULT)
    if served != args.model:
        raise SystemExit(f"the {system} server serves {served}: give --model {served} (every call of a lease)")
    return Target(system, state["url"], state["model"], MODELS[args.model].video_kwargs, not args.no_timelines)


def expand(names: list[str]) -> list[str]:
    """``goodput_<workload>`` becomes its unloaded pass and every default rate; other names stay."""
    out = []
    for name in names:
        workload = name.removeprefix("goodput_")
        if name.startswith("goodput_") and workload in scenarios.GOODPUT_RATES:
            out += [f"{name}@unloaded", *(f"{name}@{rate}" for rate in scenarios.GOODPUT_RATES[workload])]
        else:
            out.append(name)
    return out


def passes(args: argparse.Namespace, name: str) -> range:
    """The passes of scenario ``name`` (``--passes`` for a fixed scenario; one for the others: a goodput rate or a
    cache scenario's second pass would not be the same test, its media cached or its load other)."""
    return range(1, (args.passes if name in scenarios.FIXED else 1) + 1)


def drop_later_passes(folder: Path, name: str) -> None:
    """Remove the raw files of scenario ``name``'s passes after the first from ``folder``: a new first pass makes
    them stale (they would be taken into its medians)."""
    for stale in folder.glob(f"{raw_stem(name)}.pass*.json"):
        stale.unlink()


def profiled_processes(state: dict, names: list[str]) -> dict[str, int]:
    """The pids of the server processes named in ``names`` (``process_cpu.server_processes``' names), one entry
    each (``openai_api_1``... for the API's workers). Raises SystemExit for a name the server has not."""
    found = process_cpu.server_processes(state["pid"])
    missing = sorted(set(names) - set(found))
    if missing:
        raise SystemExit(f"--py-spy: no process {missing} (the server's: {sorted(found)})")
    return {(n if k == 0 else f"{n}_{k}"): pid for n in names for k, pid in enumerate(found[n])}


def run_scenarios(args: argparse.Namespace, system: str) -> int:
    """Run the chosen scenarios against ``system``'s running server, each written as soon as it ends.
    Returns the number of failed requests."""
    p = paths(args)
    state = servers.running(system, p["state"])
    target = target_of(args, system, state)
    inputs = prepare(args)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    failed = 0
    for name, index in ((n, k) for n in expand(args.scenarios or list(scenarios.FIXED)) for k in passes(args, n)):
        if index == 1:
            drop_later_passes(p["out"] / "raw" / system, name)
        base = {**header(device), "system": system, "server_version": state["version"], "scenario": name,
                "pass": index, "peer_model": args.model,
                "smoke": args.smoke, "setup": asdict(inputs.setup), "server_argv": state["argv"],
                "timelines": target.timeline}  # whether UnifiedServe's requests asked for theirs (--no-timelines)
        if name == "crosscheck":
            result = asyncio.run(crosscheck.run(target, p["checkpoint"], p["out"] / "raw" / system / "crosscheck",
                                                args.vllm_site))
            write(p["out"] / "raw" / system, name, {**base, **result})
            print(f"{system} crosscheck: ours / vllm bench serve {result['ours_over_vllm_bench']}", flush=True)
            continue
        port = servers.metrics_port(state)  # UnifiedServe's: its metrics and its processes are read too
        before = (read_metrics(port), process_cpu.snapshot(state["pid"])) if port else None
        cache_before = prefix_cache.read(system, state)
        started = time.monotonic()
        profiled = profiled_processes(state, args.py_spy) if port and args.py_spy else {}
        spied = p["out"] / "py_spy" / system / raw_stem(name, index)
        with GpuSampler() as gpu, py_spy.Profiles(profiled, spied) as profiles:
            records, base["client_loop"] = client_loop.run(scenarios.run(
                name, target, inputs, args.requests, args.seed, args.questions, args.streams))
        base["gpu_busy"] = gpu.result
        if profiled:
            write(p["out"], f"py_spy_{raw_stem(name, index)}", {**base, "py_spy": profiles.result})
        if before is not None:
            # which of its processes were busy, for how much of the scenario
            base["process_busy"] = process_cpu.busy(before[1], process_cpu.snapshot(state["pid"]),
                                                    time.monotonic() - started)
            time.sleep(METRICS_SETTLE_S)  # the decode stage's own step beside the clients' TBT
            base["server_metrics"] = decode_overhead(before[0], read_metrics(port),
                                                     distribution([g for r in records for g in r.tbt_ms]))
        # vLLM's counters are current at once: a request's lookup reaches its API with the request's first outputs
        base["prefix_cache"] = prefix_cache.increase(cache_before, prefix_cache.read(system, state))
        errors = [r.error for r in records if r.error]
        failed += len(errors)
        rows = [r.to_json() for r in records]
        write(p["out"] / "raw" / system, raw_stem(name, index), {**base, "records": rows})
        ttfts = [r.ttft_ms for r in records if r.ttft_ms is not None]
        shown = f"TTFT max {max(ttfts):.0f} ms" if ttfts else "no token"
        line = figures_line(name, rows)  # this pass's (a scenario run again, not as a pass, overwrites its raw file)
        shown += f"; {line}" if line else ""
        shown_name = f"{name} pass {index}" if index > 1 else name
        print(f"{system} {shown_name}: {len(records)} requests, {len(errors)} failed, {shown}"
              + (f"; first error: {errors[0]}" if errors else ""), flush=True)
    return failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("prepare", "start", "scenarios", "stop", "summary", "all"))
    parser.add_argument("--systems", nargs="+", choices=servers.SYSTEMS, default=list(servers.SYSTEMS))
    parser.add_argument("--scenarios", nargs="+", help="default: the six fixed scenarios (module docstring)")
    parser.add_argument("--work", default="/tmp/peer", help="checkpoint, media and server state (kept)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "peer"), help="results folder")
    parser.add_argument("--smoke", action="store_true", help="UnifiedServe's tiny default model, the small media")
    parser.add_argument("--model", choices=sorted(MODELS), default=DEFAULT,
                        help="the checkpoint (prepare) and the servers' settings (start); not with --smoke")
    parser.add_argument("--vllm-site", default="/tmp/vllm-site", help="the unpacked vLLM bundle (put on PYTHONPATH)")
    parser.add_argument("--ready-timeout", type=float, default=480.0,
                        help="seconds a server may take to load (a device call lasts at most 600 s)")
    parser.add_argument("--requests", type=int,
                        help="requests per goodput rate (default: per workload; multiturn: sessions)")
    parser.add_argument("--text-tokens", type=int, default=0,
                        help="max_tokens of the text requests (default: the setup's, 256; with --smoke 32)")
    parser.add_argument("--seed", type=int, default=0, help="the goodput arrivals' and output lengths' seed")
    parser.add_argument("--clips", type=int, default=scenarios.MULTITURN_CLIPS, help="multiturn's distinct clips")
    parser.add_argument("--clip-seconds", type=int, default=scenarios.CLIP_SECONDS,
                        help="multiturn's clip length (s, a multiple of 20)")
    parser.add_argument("--questions", type=int, default=scenarios.MULTITURN_QUESTIONS,
                        help=f"multiturn's questions per clip (at most {len(scenarios.QUESTIONS)})")
    parser.add_argument("--streams", type=int, default=scenarios.MULTITURN_STREAMS,
                        help="multiturn's clips asked about at once (each clip's questions one after another)")
    parser.add_argument("--py-spy", nargs="+", default=[], metavar="PROCESS",
                        help="UnifiedServe processes to sample with py-spy during each scenario (orchestrator, "
                             "decode, encode_prefill, flashcodec, tritonserver, openai_api): py_spy.py")
    parser.add_argument("--passes", type=int, default=1,
                        help="run each fixed scenario this many times in a row; the summary takes each figure's median "
                             "over the passes, the report gives every pass's (raw files <scenario>.pass<k>.json)")
    parser.add_argument("--no-timelines", action="store_true",
                        help="do not ask UnifiedServe for its requests' timelines (their per-token upkeep in the "
                             "orchestrator is left out of its figures; timelines.json and the gap analysis go too)")
    parser.add_argument("--caches", action="store_true",
                        help="start the systems with their prefix caches on (vLLM's processor cache too; issue 21's "
                             "cache scenarios); off by default")
    parser.add_argument("--server-arg", action="append", default=[], dest="server_args", metavar="ARG",
                        help="one more argument for the server's command line (repeatable; e.g. --server-arg=--set "
                             "--server-arg=orchestrator.encode_budget=61440)")
    args = parser.parse_args()
    if args.passes < 1:
        parser.error(f"--passes must be at least 1, got {args.passes}")
    if args.smoke and args.model != DEFAULT:
        parser.error("--smoke serves UnifiedServe's tiny default model: leave --model out")
    failed = 0
    if args.command in ("prepare", "all"):
        prepare(args)
    for system in args.systems:
        if args.command == "stop":
            servers.stop(system, paths(args)["state"])
        try:
            if args.command in ("start", "all"):
                start(args, system)
            if args.command in ("scenarios", "all"):
                failed += run_scenarios(args, system)
        finally:
            if args.command == "all":
                servers.stop(system, paths(args)["state"])
    if args.command in ("summary", "all"):
        print(f"wrote {write_summary(paths(args)['out'])}", flush=True)
    if failed:
        sys.exit(f"{failed} requests failed (their errors are in the raw JSON)")


if __name__ == "__main__":
    main()
