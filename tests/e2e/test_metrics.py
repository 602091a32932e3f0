"""UnifiedServe's metrics on ``/metrics`` after real requests (orchestrator/metrics.py, backends/triton/histograms.py):
each per-request histogram counts the requests sent, its buckets are cumulative and end at its count, the latencies
agree with each other, and the token counters add up to what the clients saw."""
from __future__ import annotations

import re

import pytest

from client.api import Client
from orchestrator.metrics import DECODE, E2E, HISTOGRAMS, ITL, PREFILL, QUEUE, SUCCESS, TTFT, VISUAL
from tests.e2e.conftest import metrics_text, settled
from tests.media import make_image

pytestmark = pytest.mark.e2e
GREEDY = {"temperature": 0, "ignore_eos": True}
LABEL = re.compile(r'(\w+)="([^"]*)"')
Series = tuple[str, tuple[tuple[str, str], ...]]  # (name, sorted label items)


def scrape(server) -> tuple[dict[Series, float], dict[str, str]]:
    """UnifiedServe's series ({(name, labels): value}) and each family's ``# TYPE``."""
    values, types = {}, {}
    for line in metrics_text(server).splitlines():
        if line.startswith("# TYPE unifiedserve_"):
            _, _, family, kind = line.split()
            types[family] = kind
        elif line.startswith("unifiedserve_"):
            head, value = line.rsplit(" ", 1)
            name, _, labels = head.partition("{")
            values[(name, tuple(sorted(LABEL.findall(labels))))] = float(value)
    return values, types


def grown(before: dict[Series, float], after: dict[Series, float], name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after[key] - before.get(key, 0.0)


def buckets(values: dict[Series, float], histogram: str) -> list[tuple[float, float]]:
    """(le, value) of the unlabelled histogram's buckets, in le order."""
    found = [(float(dict(labels)["le"].replace("+Inf", "inf")), v) for (name, labels), v in values.items()
             if name == histogram + "_bucket"]
    return sorted(found)


def test_latency_histograms_count_the_requests_and_token_counters_add_up(server, grpc_url):
    before = settled(lambda: scrape(server)[0])
    with Client(grpc_url) as client:
        results = [client.generate("Hello there", sampling={**GREEDY, "max_tokens": 6}, return_output_ids=True),
                   client.generate("Describe the picture.", image=make_image(112, 112),
                                   sampling={**GREEDY, "max_tokens": 4}, return_output_ids=True),
                   client.generate("Count to three", sampling={**GREEDY, "max_tokens": 1}, return_output_ids=True)]
    assert [r.finish_reason for r in results] == ["length"] * 3
    after, types = settled(lambda: scrape(server))

    for name in (TTFT, E2E, QUEUE, PREFILL, DECODE, VISUAL):
        assert grown(before, after, name + "_count") == 3, name
    for name in HISTOGRAMS:
        now = buckets(after, name)
        assert [le for le, _ in now] == sorted({*HISTOGRAMS[name].bounds, float("inf")}), name
        assert all(a <= b for (_, a), (_, b) in zip(now, now[1:])), (name, now)  # cumulative
        assert now[-1][1] == after[(name + "_count", ())], name  # +Inf is the count
        assert {types[name + suffix] for suffix in ("_bucket", "_sum", "_count")} == {"counter"}
    # one gap per output after the first, an output carrying the tokens that came since the last: no more gaps than
    # tokens after the first, and no fewer than responses after the first (a send lane that fell behind merges
    # outputs into one response, as in about 2% of 8-token streams on a loaded 2-core machine)
    assert sum(r.num_responses - 1 for r in results) <= grown(before, after, ITL + "_count") \
        <= sum(r.num_output_tokens - 1 for r in results)
    # per request: the gaps span its first output to its last, inside its end-to-end time after the first token;
    # its queue and prefill time end at the engine's first token, before that token leaves
    ttft, e2e = grown(before, after, TTFT + "_sum"), grown(before, after, E2E + "_sum")
    assert 0 < grown(before, after, ITL + "_sum") <= e2e - ttft
    assert 0 < grown(before, after, QUEUE + "_sum") + grown(before, after, PREFILL + "_sum") <= ttft
    assert grown(before, after, DECODE + "_sum") <= e2e
    # the two text requests have no visual tokens; the image's are part of its prompt
    assert grown(before, after, VISUAL + "_bucket", le="0") == 2
    assert 0 < grown(before, after, VISUAL + "_sum") < results[1].num_input_tokens

    assert grown(before, after, "unifiedserve_prompt_tokens_total") == sum(r.num_input_tokens for r in results)
    assert grown(before, after, "unifiedserve_generation_tokens_total") == sum(len(r.token_ids) for r in results) \
        == sum(r.num_output_tokens for r in results) == 11
    assert grown(before, after, SUCCESS, finished_reason="length") == 3
    assert grown(before, after, "unifiedserve_scheduler_steps_total") >= 3
    steps = grown(before, after, "unifiedserve_decode_step_seconds_count", replica="0")
    assert steps >= 5 and grown(before, after, "unifiedserve_decode_step_sequences_total", replica="0") >= steps
    for name in ("unifiedserve_prompt_tokens_total", "unifiedserve_generation_tokens_total", SUCCESS,
                 "unifiedserve_scheduler_steps_total", "unifiedserve_decode_step_sequences_total"):
        assert types[name] == "counter", name
    assert types["unifiedserve_kv_cache_usage_perc"] == "gauge"
    assert after[("unifiedserve_kv_cache_usage_perc", ())] == 0  # idle: every KV page free


def test_a_cancelled_request_counts_as_abort(server, grpc_url):
    before = settled(lambda: scrape(server)[0])
    with Client(grpc_url) as client:
        partial = client.generate("Go on.", sampling={**GREEDY, "max_tokens": 2000}, cancel_after_responses=2)
    assert partial.finish_reason == "cancelled"
    after = settled(lambda: scrape(server)[0])
    assert grown(before, after, SUCCESS, finished_reason="abort") == 1
    assert grown(before, after, E2E + "_count") == grown(before, after, TTFT + "_count") == 1
    assert grown(before, after, DECODE + "_count") == 1
