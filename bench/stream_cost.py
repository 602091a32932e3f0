"""What a streamed token costs the server's processes, and how long the orchestrator holds it (issue 20, item 2).

    python bench/stream_cost.py --out DIR [--streams 32] [--tokens 256] [--rounds 3] [--no-timelines]
                                [--top-logprobs K] [--set MODEL.KEY=VALUE ...]

Serves UnifiedServe as the peer benchmark does (``bench.peer.servers``, its tiny default model unless ``--set``
names another; a real tritonserver and the OpenAI API), warms it up, then runs ``--rounds`` rounds of ``--streams``
streamed chat requests of ``--tokens`` tokens each, all sent at once through ``bench.peer.load`` (the peer bench's
load generator; with ``--top-logprobs K`` each asks for its tokens' log probabilities with K top tokens, OpenAI's
``logprobs``/``top_logprobs``). Per round:

* ``cpu_us_per_token``: each server process's CPU time (``bench.peer.process_cpu``: user + system, from /proc) over
  the round, divided by the tokens the clients received (microseconds a token);
* ``hops``: mean, p50, p90, p99 and max (ms) from the requests' timelines (``return_timeline``; none with ``--no-timelines``) of
  ``read_to_received`` (decode's read of the step's tokens to their arrival in the orchestrator) and
  ``received_to_sent`` (that arrival to the return of the Triton send that brought the token to its client: the
  orchestrator's own hold of it, the send lanes included).

On the 2-core CPU machine decode's own steps take most of the cores, so its CPU figures are the server's cost
per token there; the hops on the H200 come from the peer bench's ``timelines.json`` (``token_gaps``). A CPU figure,
not a speed claim against another system: no baseline runs beside it. Writes ``DIR/stream_cost.json``.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import header, write  # noqa: E402
from bench.peer import process_cpu, servers  # noqa: E402
from bench.peer.load import ChatRequest, Target, chat_parts, open_loop  # noqa: E402
from bench.serve_bench import TEXT_PROMPT, distribution  # noqa: E402

WARMUP_STREAMS = 4


def hops(records) -> dict[str, dict]:
    """The timelines' ``read_to_received`` and ``received_to_sent`` per token (ms; module docstring), as
    ``serve_bench.distribution``s; {} without timelines."""
    gaps: dict[str, list[float]] = {"read_to_received": [], "received_to_sent": []}
    for record in records:
        tokens = (record.timeline or {}).get("tokens") or {}
        received = tokens.get("received_us", [])  # tokens from decode: all but the first; µs since arrival
        gaps["read_to_received"] += [(b - a) / 1e3 for a, b in zip(tokens.get("decode_read_us", []), received)
                                     if a is not None]
        gaps["received_to_sent"] += [(b - a) / 1e3 for a, b in zip(received, tokens.get("sent_us", [])[1:])]
    return {name: distribution(values) for name, values in gaps.items() if values}


def run_round(pid: int, target: Target, request: ChatRequest, streams: int) -> dict:
    """One round of ``streams`` requests at once against the server of launcher ``pid``."""
    before, started = process_cpu.snapshot(pid), time.monotonic()
    records = asyncio.run(open_loop(target, [(0.0, request)] * streams))
    wall_s = time.monotonic() - started
    after = process_cpu.snapshot(pid)
    tokens = sum(len(r.token_s) for r in records)
    return {"tokens": tokens, "errors": [r.error for r in records if r.error][:3], "wall_s": round(wall_s, 3),
            "cpu_us_per_token": {name: round((after[name] - before[name]) / tokens * 1e6, 1)
                                 for name in sorted(after) if name in before and tokens},
            "hops": hops(records)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="results folder")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256, help="output tokens a request (ignore_eos)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-timelines", action="store_true", help="do not ask for the requests' timelines")
    parser.add_argument("--top-logprobs", type=int, default=None, metavar="K",
                        help="ask for each token's log probability and K top tokens' (default: no log probabilities)")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="MODEL.KEY=VALUE",
                        help="a repository parameter for the server (repeatable)")
    parser.add_argument("--work", default="/tmp/stream_cost", help="the server's state and log")
    args = parser.parse_args()
    work = Path(args.work)
    extra = [a for item in args.overrides for a in ("--set", item)]
    argv, env = servers.command("unifiedserve", work, work, True, extra)
    state = servers.start("unifiedserve", argv, env, work / "state", work / "server.log", None, 600.0)
    try:
        target = Target("unifiedserve", state["url"], state["model"], timelines=not args.no_timelines)
        asked = () if args.top_logprobs is None else (("logprobs", True), ("top_logprobs", args.top_logprobs))
        request = ChatRequest("text", chat_parts(TEXT_PROMPT), args.tokens, extra=asked)
        asyncio.run(open_loop(target, [(0.0, request)] * WARMUP_STREAMS))
        rounds = []
        for _ in range(args.rounds):
            rounds.append(run_round(state["pid"], target, request, args.streams))
            print(rounds[-1], flush=True)
    finally:
        servers.stop("unifiedserve", work / "state")
    path = write(Path(args.out), "stream_cost", {
        **header(torch.device("cpu")), "server_argv": argv, "streams": args.streams, "tokens": args.tokens,
        "timelines": not args.no_timelines, "top_logprobs": args.top_logprobs, "rounds": rounds})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
