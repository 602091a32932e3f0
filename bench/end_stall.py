"""What many requests ending in one decode step cost the streams still running, and their own final responses.

    python bench/end_stall.py --out DIR [--ending 16] [--running 16] [--tokens 64] [--more 64] [--rounds 3]
                              [--py-spy] [--name NAME] [--set MODEL.KEY=VALUE ...]

Serves UnifiedServe as the peer benchmark does (``bench.peer.servers``, the tiny default model; a real tritonserver
and the OpenAI API, whose streamed requests go on its token channel), warms it up, then per round sends at once
``--ending`` streamed chat requests of ``--tokens`` tokens and ``--running`` of ``--tokens`` + ``--more`` (the same
prompt, ``ignore_eos``, ``return_timeline``): the first ones end in the same decode step while the others stream on.
From the requests' timelines (``orchestrator/timeline.py``; moments placed on one clock with ``arrived_monotonic_s``):

* ``final_after_last_ms``: per ending request, its ``final_response`` mark minus its ``last_token`` mark (the
  orchestrator's hold of its end: the response with its timeline built on the channel's send lane);
* ``ending_last_hold_ms``: per ending request, its last token's ``sent_us`` minus its ``received_us`` (ms): how
  long the orchestrator held the last token (behind the other ends' upkeep, before 2026-12-06's change);
* ``running_hold_ms``: for the running requests' tokens received in the ``WINDOW_MS`` after the first ending
  request's last token, ``sent_us`` minus ``received_us`` (ms), beside ``running_hold_elsewhere_ms``, the same for
  their tokens received more than ``WINDOW_MS`` away from the ends (the usual hold);
* ``decode``: decode's step launches (every token's ``decode_launched_us``, one per step) and reads: the spacing
  of launches around the step that read the ending requests' last tokens (``launch_gap_at_end_ms``: that step's
  launch to the next one's) and elsewhere, and the steps' launch-to-read times.

With ``--py-spy`` each round is profiled (``bench.peer.py_spy.Profiles``: ``RATE_HZ``, per thread) in the
orchestrator's and decode's stub processes; the collapsed stacks go to ``DIR/<name>_py_spy_<round>/<process>.txt`` and
their top functions into the JSON (``bench.peer.py_spy.top``). On the 2-core CPU machine decode's steps, the API process
and the orchestrator share two cores: these are CPU figures, compared between commits in one session, not speed
claims. Writes ``DIR/<name>.json``.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import header, write  # noqa: E402
from bench.peer import process_cpu, py_spy, servers  # noqa: E402
from bench.peer.load import ChatRequest, Target, chat_parts, open_loop  # noqa: E402
from bench.serve_bench import TEXT_PROMPT, distribution  # noqa: E402

WINDOW_MS = 60.0  # after the first ending request's last token: the running streams' tokens counted as "at the end"
RATE_HZ = 1000
WARMUP_STREAMS = 4


def _event(timeline: dict, name: str) -> float | None:
    """Event ``name``'s moment (``time.monotonic()`` seconds), None if not recorded."""
    for event in timeline.get("events", ()):
        if event["event"] == name:
            return timeline["arrived_monotonic_s"] + event["ms"] / 1e3
    return None


def _moments(timeline: dict, name: str) -> list[float | None]:
    """A per-token list of the timeline's (µs since arrival) as ``time.monotonic()`` seconds."""
    base = timeline["arrived_monotonic_s"]
    return [None if us is None else base + us / 1e6 for us in (timeline.get("tokens") or {}).get(name, ())]


def analyse(records, ending: int) -> dict:
    """The figures of the module docstring from one round's records (the first ``ending`` are the ending ones)."""
    timelines = [r.timeline or {} for r in records]
    ends, runs = timelines[:ending], timelines[ending:]
    last = [t for t in (_event(tl, "last_token") for tl in ends) if t is not None]
    finals = [((_event(tl, "final_response") or 0) - (_event(tl, "last_token") or 0)) * 1e3 for tl in ends
              if _event(tl, "final_response") and _event(tl, "last_token")]
    if not last:
        return {"errors": [r.error for r in records if r.error][:3]}
    end = min(last)
    near, far = [], []
    for tl in runs:
        received, sent = _moments(tl, "received_us"), _moments(tl, "sent_us")[1:]
        for r, s in zip(received, sent):
            if r is None or s is None:
                continue
            (near if 0 <= (r - end) * 1e3 <= WINDOW_MS else far if abs(r - end) * 1e3 > WINDOW_MS else []).append(
                (s - r) * 1e3)
    steps: dict[int, float] = {}  # launch (µs, rounded) -> read
    for tl in timelines:
        for launched, read in zip(_moments(tl, "decode_launched_us"), _moments(tl, "decode_read_us")):
            if launched is not None and read is not None:
                steps.setdefault(round(launched * 1e4), read)  # 0.1 ms buckets: one step's launch on every timeline
    launches = sorted(steps)
    reads = [steps[k] for k in launches]
    launches_s = [k / 1e4 for k in launches]
    gaps = [(b - a) * 1e3 for a, b in zip(launches_s, launches_s[1:])]
    read_after = [(r - a) * 1e3 for a, r in zip(launches_s, reads)]
    # the step that read the last tokens: the last launched at or before the first last_token mark
    at = max((k for k, a in enumerate(launches_s) if reads[k] <= end + 1e-4), default=None)
    around = {}
    if at is not None:
        around = {"launch_gaps_ms": [round(g, 2) for g in gaps[max(0, at - 3):at + 4]],
                  "launch_gap_at_end_ms": round(gaps[at], 2) if at < len(gaps) else None,
                  "read_after_launch_at_end_ms": round(read_after[at], 2),
                  "read_to_last_token_mark_ms": round((end - reads[at]) * 1e3, 2)}
    finals_at = sorted((_event(tl, "final_response") or 0) - end for tl in ends)
    last_held = [(sent[-1] - received[-1]) * 1e3 for received, sent in
                 ((_moments(tl, "received_us"), _moments(tl, "sent_us")) for tl in ends)
                 if received and sent and received[-1] is not None and sent[-1] is not None]
    return {
        "final_after_last_ms": distribution(finals),
        "final_marks_after_first_last_token_ms": [round(x * 1e3, 2) for x in finals_at],
        "last_token_spread_ms": round((max(last) - end) * 1e3, 2),
        "ending_last_hold_ms": distribution(last_held),
        "running_hold_ms": distribution(near), "running_hold_elsewhere_ms": distribution(far),
        "decode": {"steps": len(launches), "launch_gap_ms": distribution(gaps),
                   "read_after_launch_ms": distribution(read_after), **around},
        "errors": [r.error for r in records if r.error][:3]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="results folder")
    parser.add_argument("--name", default="end_stall", help="the results file's name (without .json)")
    parser.add_argument("--ending", type=int, default=16, help="requests that end in the same step")
    parser.add_argument("--running", type=int, default=16, help="requests still streaming then")
    parser.add_argument("--tokens", type=int, default=64, help="the ending requests' output tokens")
    parser.add_argument("--more", type=int, default=64, help="the running requests' tokens beyond --tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--py-spy", action="store_true", help="profile the orchestrator and decode (module doc)")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="MODEL.KEY=VALUE")
    parser.add_argument("--work", default="/tmp/end_stall", help="the server's state and log")
    args = parser.parse_args()
    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    argv, env = servers.command("unifiedserve", work, work, True, [a for s in args.overrides for a in ("--set", s)])
    state = servers.start("unifiedserve", argv, env, work / "state", work / "server.log", None, 600.0)
    try:
        target = Target("unifiedserve", state["url"], state["model"])
        parts = chat_parts(TEXT_PROMPT)
        asyncio.run(open_loop(target, [(0.0, ChatRequest("text", parts, 16))] * WARMUP_STREAMS))
        processes = process_cpu.server_processes(state["pid"])
        pids = {name: processes[name][0] for name in ("orchestrator", "decode") if name in processes}
        schedule = [(0.0, ChatRequest("text", parts, args.tokens))] * args.ending + \
            [(0.0, ChatRequest("text", parts, args.tokens + args.more))] * args.running
        rounds = []
        for k in range(args.rounds):
            spied = pids if args.py_spy else {}
            with py_spy.Profiles(spied, out / f"{args.name}_py_spy_{k}", RATE_HZ, threads=True) as profiles:
                records = asyncio.run(open_loop(target, schedule))
            rounds.append({**analyse(records, args.ending), **({"py_spy": profiles.result} if spied else {})})
            print({key: value for key, value in rounds[-1].items() if key != "py_spy"}, flush=True)
    finally:
        servers.stop("unifiedserve", work / "state")
    summary = {name: statistics.median(r[name]["p50"] for r in rounds if r.get(name))
               for name in ("final_after_last_ms", "ending_last_hold_ms", "running_hold_ms",
                            "running_hold_elsewhere_ms")}
    path = write(out, args.name, {**header(torch.device("cpu")), "server_argv": argv, "pids": pids,
                                  **{k: getattr(args, k) for k in ("ending", "running", "tokens", "more")},
                                  "window_ms": WINDOW_MS, "median_p50s": summary, "rounds": rounds})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
