"""Our load generator checked against vLLM's own (``vllm bench serve``) on one shared text scenario.

The peer benchmark drives both systems with ``bench.peer.load`` because ``vllm bench serve`` cannot express most
of its workloads (a local 3-minute video by ``file://`` path, text streams with a burst arriving at 2 s, goodput
request types with their own unloaded TTFT). Where it can, on a text-only closed loop, both generators run one
after the other against the same server with the same prompts: ``CROSSCHECK_PROMPTS`` distinct prompts of the
serve bench's story text, ``CROSSCHECK_OUTPUT`` output tokens each (``ignore_eos``, greedy), ``CROSSCHECK_STREAMS``
at once. ``vllm bench serve --backend openai-chat --dataset-name custom --skip-chat-template`` sends each prompt as
the user message, as we do. Reported per generator (ms): TTFT mean / median / p99, TPOT (per request:
(last token - first token) / (output tokens - 1)) and ITL, each mean / median / p99, and ours / theirs ratios;
agreement within a few percent says our client adds no cost of its own.

The vLLM bundle carries the ``vllm`` CLI's module; it runs as ``python3 -m vllm.entrypoints.cli.main bench serve``
with the bundle's folder first on PYTHONPATH.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from bench.peer.load import ChatRequest, RequestRecord, Target, chat_parts, closed_loop
from bench.peer.servers import VLLM_ENV, environment
from bench.serve_bench import TEXT_PROMPT

CROSSCHECK_PROMPTS = 64
CROSSCHECK_OUTPUT = 256
CROSSCHECK_STREAMS = 16


def prompts() -> list[str]:
    """The shared prompts: the serve bench's story text, numbered so that no two are alike."""
    return [f"{TEXT_PROMPT} Story number {k}." for k in range(CROSSCHECK_PROMPTS)]


def vllm_bench_command(target: Target, tokenizer: Path, dataset: Path, result_dir: Path) -> list[str]:
    """argv of ``vllm bench serve`` on the shared scenario, its JSON written to ``result_dir/vllm_bench.json``."""
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "openai-chat",
            "--base-url", target.url, "--endpoint", "/v1/chat/completions", "--model", target.model,
            "--tokenizer", str(tokenizer), "--dataset-name", "custom", "--dataset-path", str(dataset),
            "--custom-output-len", str(CROSSCHECK_OUTPUT), "--skip-chat-template", "--disable-shuffle",
            "--num-prompts", str(CROSSCHECK_PROMPTS), "--max-concurrency", str(CROSSCHECK_STREAMS),
            "--request-rate", "inf", "--ignore-eos", "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--save-result",
            "--result-dir", str(result_dir), "--result-filename", "vllm_bench.json", "--disable-tqdm"]


def our_metrics(records: list[RequestRecord]) -> dict:
    """``vllm bench serve``'s metric names (ms) computed from our records, over the requests that succeeded."""
    ok = [r for r in records if r.error is None and len(r.token_s) > 1]
    ttft = [r.ttft_ms for r in ok]
    tpot = [(r.token_s[-1] - r.token_s[0]) * 1e3 / (len(r.token_s) - 1) for r in ok]
    itl = [g for r in ok for g in r.tbt_ms]
    out = {"completed": len(ok)}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        out |= {f"mean_{name}_ms": float(np.mean(values)), f"median_{name}_ms": float(np.median(values)),
                f"p99_{name}_ms": float(np.percentile(values, 99))} if values else {}
    return out


async def run(target: Target, tokenizer: Path, out: Path, pythonpath: str | None) -> dict:
    """Run ``vllm bench serve``, then our generator, against ``target``; returns both metric sets and their ratios
    (ours / vLLM's). ``tokenizer``: the checkpoint directory; ``pythonpath``: the vLLM bundle's folder. Raises
    RuntimeError when ``vllm bench serve`` fails (its output in the message)."""
    out.mkdir(parents=True, exist_ok=True)
    dataset = out / "crosscheck_prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts()))
    done = subprocess.run(vllm_bench_command(target, tokenizer, dataset, out),
                          env=environment(VLLM_ENV, pythonpath), capture_output=True, text=True)
    (out / "vllm_bench.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    theirs = json.loads((out / "vllm_bench.json").read_text())
    requests = [ChatRequest("text", chat_parts(p), CROSSCHECK_OUTPUT) for p in prompts()]
    ours = our_metrics(await closed_loop(target, CROSSCHECK_STREAMS, requests))
    ratios = {k: ours[k] / theirs[k] for k in ours if k.endswith("_ms") and theirs.get(k)}
    return {"workload": {"prompts": CROSSCHECK_PROMPTS, "output_tokens": CROSSCHECK_OUTPUT,
                         "streams": CROSSCHECK_STREAMS},
            "vllm_bench_serve": {k: v for k, v in theirs.items() if k.endswith("_ms") or k == "completed"},
            "ours": ours, "ours_over_vllm_bench": ratios}
