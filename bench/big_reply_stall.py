"""What big echoed answers cost the other streams of the same OpenAI API process.

    python bench/big_reply_stall.py --out DIR [--streams 8] [--stream-tokens 1024] [--prompt-tokens 4096] [--top 20]
                                    [--concurrent 1] [--n 1] [--big-stream] [--tokenize | --detokenize] [--rounds 3]
                                    [--name NAME]

Serves UnifiedServe as the peer benchmark does (``bench.peer.servers``, the tiny default model; the OpenAI API with
one worker process by default, so that every request shares its event loop), then per round: ``--streams`` streamed
chat requests of ``--stream-tokens`` tokens (``ignore_eos``; enough to outlast the big requests) and, once they
stream, ``--concurrent`` completions requests at once, each echoing a prompt of ``--prompt-tokens`` token ids
with its tokens' log probabilities and ``--top`` top tokens each (lm-evaluation-harness's loglikelihood request:
``echo``, ``logprobs``, ``max_tokens`` 0), ``--n`` choices each, streamed with ``--big-stream``; with ``--tokenize``
instead ``/tokenize`` requests of a text of ``--prompt-tokens`` printable characters (one token each) asking for each
token's string (``return_token_strs``: the orchestrator's ``orchestrator/token_strings.py``); with ``--detokenize``
``/detokenize`` requests of ``--prompt-tokens`` token ids (``orchestrator.prompt.token_prompt_text``). A big answer is
several MB of JSON (``bytes``), which the API process reads and writes. Per round, from the clients' records
(``bench.peer.load``): ``reply_ms``, the big requests' latencies; ``gap_max_ms`` / ``gap_p99_ms``, the streams'
longest and p99 gap between tokens over the round; ``longest_gaps``, the three longest as (ms, start, end), ms after
the big requests were sent (a stall of the API's loop ends just before a big answer reaches its client). The CPU
machine's two cores are shared by decode, the prefill of the big prompts and the API: these are CPU figures,
compared between commits in the same session, not speed claims. Writes ``DIR/<name>.json``.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import torch  # noqa: E402

from bench.common import header, write  # noqa: E402
from bench.peer import servers  # noqa: E402
from bench.peer.load import ChatRequest, Target, chat_parts, open_loop  # noqa: E402
from bench.serve_bench import TEXT_PROMPT, distribution  # noqa: E402

START_AFTER_S = 1.0  # the big requests are sent this long after the streams


async def big_request(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, int]:
    """(when the answer was whole: time.perf_counter() seconds, its bytes) of one big request (``/tokenize`` for a
    body with ``return_token_strs``, ``/detokenize`` for one with ``tokens``, else ``/v1/completions``)."""
    route = "/tokenize" if "return_token_strs" in body else "/detokenize" if "tokens" in body else "/v1/completions"
    async with client.stream("POST", f"{url}{route}", json=body) as response:
        response.raise_for_status()
        size = sum([len(chunk) async for chunk in response.aiter_bytes()])
    return time.perf_counter(), size


def big_body(model: str, args: argparse.Namespace) -> dict:
    """A big request's JSON body (module docstring)."""
    if args.tokenize:  # printable characters, one token each in the tiny tokenizer
        return {"model": model, "prompt": "".join(chr(32 + k % 94) for k in range(args.prompt_tokens)),
                "return_token_strs": True}
    prompt = [k % 94 for k in range(args.prompt_tokens)]  # token ids: the tiny tokenizer's printable bytes
    if args.detokenize:
        return {"model": model, "tokens": prompt}
    return {"model": model, "prompt": prompt, "echo": True, "logprobs": args.top, "max_tokens": 0, "n": args.n,
            "stream": args.big_stream}


async def one_round(target: Target, args: argparse.Namespace) -> dict:
    request = ChatRequest("text", chat_parts(TEXT_PROMPT), args.stream_tokens)
    start = time.perf_counter()
    loop = asyncio.create_task(open_loop(target, [(0.0, request)] * args.streams, start))
    await asyncio.sleep(START_AFTER_S)
    body = big_body(target.model, args)
    async with httpx.AsyncClient(timeout=600) as client:
        sent = time.perf_counter()
        answers = await asyncio.gather(*(big_request(client, target.url, body) for _ in range(args.concurrent)))
    records = await loop
    gaps = []  # (ms, start, end: ms after the big requests' send)
    for record in records:
        arrivals = [(record.sent_s + t + start - sent) * 1e3 for t in record.token_s]
        gaps += [(b - a, a, b) for a, b in zip(arrivals, arrivals[1:])]
    longest = sorted(gaps, reverse=True)[:3]
    gap = distribution([g for g, _, _ in gaps])
    return {"reply_ms": [round((received - sent) * 1e3, 1) for received, _ in answers],
            "bytes": [size for _, size in answers], "gap_max_ms": gap["max"], "gap_p99_ms": gap["p99"],
            "longest_gaps": [[round(x, 1) for x in g] for g in longest],
            "errors": [r.error for r in records if r.error][:3]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="results folder")
    parser.add_argument("--name", default="big_reply_stall", help="the results file's name (without .json)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--stream-tokens", type=int, default=1024, help="output tokens a stream")
    parser.add_argument("--prompt-tokens", type=int, default=4096, help="the echoed prompt's length (token ids)")
    parser.add_argument("--top", type=int, default=20, help="top tokens a prompt token (completions' logprobs)")
    parser.add_argument("--concurrent", type=int, default=1, help="big requests sent at once")
    parser.add_argument("--n", type=int, default=1, help="choices a big request")
    parser.add_argument("--big-stream", action="store_true", help="stream the big requests' answers")
    big = parser.add_mutually_exclusive_group()
    big.add_argument("--tokenize", action="store_true",
                     help="big requests to /tokenize with return_token_strs (a text of --prompt-tokens characters)")
    big.add_argument("--detokenize", action="store_true", help="big requests to /detokenize (--prompt-tokens ids)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", default="/tmp/big_reply_stall", help="the server's state and log")
    args = parser.parse_args()
    work = Path(args.work)
    argv, env = servers.command("unifiedserve", work, work, True, [])
    state = servers.start("unifiedserve", argv, env, work / "state", work / "server.log", None, 600.0)
    try:
        target = Target("unifiedserve", state["url"], state["model"], timelines=False)
        warm = big_body(target.model, args)

        async def warm_up():
            async with httpx.AsyncClient(timeout=600) as client:
                await big_request(client, target.url, warm)
        asyncio.run(warm_up())
        rounds = []
        for _ in range(args.rounds):
            rounds.append(asyncio.run(one_round(target, args)))
            print(rounds[-1], flush=True)
    finally:
        servers.stop("unifiedserve", work / "state")
    settings = {key: getattr(args, key) for key in ("streams", "stream_tokens", "prompt_tokens", "top", "concurrent",
                                                    "n", "big_stream", "tokenize", "detokenize")}
    path = write(Path(args.out), args.name, {**header(torch.device("cpu")), "server_argv": argv, **settings,
                                              "rounds": rounds})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
