"""What one big non-streamed reply costs the other streams of the same OpenAI API process.

    python bench/big_reply_stall.py --out DIR [--streams 8] [--prompt-tokens 4096] [--top 20] [--rounds 3]

Serves UnifiedServe as the peer benchmark does (``bench.peer.servers``, the tiny default model; the OpenAI API with
one worker process by default, so that every request shares its event loop), then per round: ``--streams`` streamed chat
requests of ``--stream-tokens`` tokens (``ignore_eos``; enough to outlast the big request) and, once they stream, one completions request, not streamed, that echoes a
prompt of about ``--prompt-tokens`` tokens with its tokens' log probabilities and ``--top`` top tokens each
(lm-evaluation-harness's loglikelihood request: ``echo``, ``logprobs``, ``max_tokens`` 0). Its reply body is several
MB of JSON (``bytes``), which the API process reads and writes. Per round, from the clients' records (``bench.peer.
load``): ``reply_ms``, the big request's latency; ``gap_max_ms`` / ``gap_p99_ms``, the streams' longest and p99 gap
between tokens over the whole round; ``gap_at_reply_ms``, the longest gap that spans the moment the big reply
reached its client (the API's work on that reply ends there: a stall of the loop shows as a gap that ends just after
it). The CPU machine's two cores are shared by decode, the prefill of the big prompt and the API: these are CPU
figures, compared between commits in the same session, not speed claims. Writes ``DIR/big_reply_stall.json``.
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

START_AFTER_S = 1.0  # the big request is sent this long after the streams


async def big_request(url: str, model: str, prompt: str, top: int) -> tuple[float, float, int]:
    """(sent, received: time.perf_counter() seconds, body bytes) of one echo request, not streamed."""
    body = {"model": model, "prompt": prompt, "echo": True, "logprobs": top, "max_tokens": 0}
    async with httpx.AsyncClient(timeout=600) as client:
        sent = time.perf_counter()
        response = await client.post(f"{url}/v1/completions", json=body)
        received = time.perf_counter()
    response.raise_for_status()
    return sent, received, len(response.content)


async def one_round(target: Target, streams: int, stream_tokens: int, prompt: str, top: int) -> dict:
    request = ChatRequest("text", chat_parts(TEXT_PROMPT), stream_tokens)
    start = time.perf_counter()
    loop = asyncio.create_task(open_loop(target, [(0.0, request)] * streams, start))
    await asyncio.sleep(START_AFTER_S)
    sent, received, size = await big_request(target.url, target.model, prompt, top)
    records = await loop
    gaps = []  # (ms, start, end: ms after the big request's send)
    for record in records:
        arrivals = [(record.sent_s + t + start - sent) * 1e3 for t in record.token_s]
        gaps += [(b - a, a, b) for a, b in zip(arrivals, arrivals[1:])]
    longest = sorted(gaps, reverse=True)[:3]
    gap = distribution([g for g, _, _ in gaps])
    return {"reply_ms": round((received - sent) * 1e3, 1), "bytes": size, "gap_max_ms": gap["max"],
            "gap_p99_ms": gap["p99"], "longest_gaps": [[round(x, 1) for x in g] for g in longest],
            "errors": [r.error for r in records if r.error][:3]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="results folder")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--stream-tokens", type=int, default=1024, help="output tokens a stream")
    parser.add_argument("--prompt-tokens", type=int, default=4096, help="the echoed prompt's length (about)")
    parser.add_argument("--top", type=int, default=20, help="top tokens a prompt token (completions' logprobs)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", default="/tmp/big_reply_stall", help="the server's state and log")
    args = parser.parse_args()
    work = Path(args.work)
    argv, env = servers.command("unifiedserve", work, work, True, [])
    state = servers.start("unifiedserve", argv, env, work / "state", work / "server.log", None, 600.0)
    prompt = " ".join(f"w{k % 997}" for k in range(args.prompt_tokens // 2))  # about two tokens a word
    try:
        target = Target("unifiedserve", state["url"], state["model"], timelines=False)
        asyncio.run(big_request(target.url, target.model, prompt, args.top))  # warm-up
        rounds = []
        for _ in range(args.rounds):
            rounds.append(asyncio.run(one_round(target, args.streams, args.stream_tokens, prompt, args.top)))
            print(rounds[-1], flush=True)
    finally:
        servers.stop("unifiedserve", work / "state")
    path = write(Path(args.out), "big_reply_stall", {
        **header(torch.device("cpu")), "server_argv": argv, "streams": args.streams, "stream_tokens": args.stream_tokens,
        "prompt_tokens": args.prompt_tokens, "top": args.top, "rounds": rounds})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
