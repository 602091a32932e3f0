"""The prefix cache through a real tritonserver (orchestrator/prefix_cache.py; on by default): a second question
about the same video or image shares the first one's KV pages, decodes and encodes none of its media, prefills only
its new tokens, and streams what transformers' generate() gives for it; cancelling a request whose pages another
shares leaves the other whole; the cache's counters on /metrics."""
from __future__ import annotations

import threading

import pytest
import torch

from backends.runtime.loader import ModelSpec, load_model
from client.api import Client
from tests.e2e.conftest import metrics_text, settled, wait_for_idle_pools
from tests.media import make_image, make_video
from tests.reference import assert_same_or_tie, server_request_reference

pytestmark = pytest.mark.e2e
N = 8
GREEDY = {"max_tokens": N, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def hf():
    return load_model(ModelSpec(device="cuda:0" if torch.cuda.is_available() else "cpu"))


def counters(server) -> dict[str, float]:
    """The prefix and encoder caches' counters and gauges (name without the ``unifiedserve_`` prefix)."""
    return {line.split()[0].removeprefix("unifiedserve_"): float(line.split()[1])
            for line in metrics_text(server).splitlines()
            if line.startswith(("unifiedserve_prefix_cache_", "unifiedserve_encoder_cache_"))}


def ask(client, question, **media):
    result = client.generate(question, sampling=GREEDY, return_output_ids=True, return_timeline=True, **media)
    events = result.timeline["events"]
    added = next(e for e in events if e["event"] == "engine_added")
    prompt = next(e for e in events if e["event"] == "prompt_built")
    steps = [e for e in events if e["event"] == "step"]
    return result, added["cached_tokens"], prompt, steps, [e for e in events if e["event"] == "group_ready"]


@pytest.mark.parametrize("kind", ["video", "image"])
def test_a_follow_up_question_shares_the_media_pages_and_equals_the_reference(server, grpc_url, hf, kind):
    # media no other test sends: the first question computes everything
    media = {kind: make_video(width=96, height=64, num_frames=12, pattern="brightness") if kind == "video"
             else make_image(232, 176, "RGB", "JPEG")}
    with Client(grpc_url) as client:
        before = settled(lambda: counters(server))
        _, first_cached, first, _, ready = ask(client, "What is this?", **media)
        assert ready and first_cached < first["tokens"] - first["visual_tokens"]  # at most the template's text
        result, cached, prompt, steps, ready = ask(client, "Which colours are there?", **media)
    after = settled(lambda: counters(server))
    # shared up to the question, in whole pages (16 tokens): the question, the template's tail (under 8 tokens) and
    # what of the page before them is not whole are prefilled
    question = len(hf[1]("Which colours are there?", add_special_tokens=False)["input_ids"])
    assert cached >= prompt["tokens"] - question - 8 - 15 and prompt["visual_tokens"] > 0
    assert sum(s["prefill_tokens"] for s in steps) == prompt["tokens"] - cached == \
        result.num_input_tokens - result.num_cached_tokens  # the last response says what was found cached
    # the group the cached prefix ends in (if it ends in one) is decoded and encoded again, no other
    assert len(ready) == sum(s["encode_groups"] for s in steps) <= 1
    assert after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"] == first_cached + cached
    assert after["prefix_cache_queries_total"] - before["prefix_cache_queries_total"] == first["tokens"] + \
        prompt["tokens"]
    assert after["prefix_cache_pages"] > 0
    reference = server_request_reference(*hf, "Which colours are there?", N, **media)
    assert_same_or_tie(result.token_ids, *reference)


def test_cancelling_a_request_whose_pages_another_shares_leaves_the_other_whole(server, grpc_url, hf):
    video = make_video(width=96, height=64, num_frames=12, pattern="gradient", fps=24)
    with Client(grpc_url) as client:
        ask(client, "Describe it.", video=video)  # its pages cached
    results = {}

    def long_one():
        with Client(grpc_url) as client:
            results["cancelled"] = client.generate("Describe it in detail.", video=video,
                                                   sampling={**GREEDY, "max_tokens": 200}, cancel_after_responses=3)

    thread = threading.Thread(target=long_one)
    thread.start()
    with Client(grpc_url) as client:
        result, cached, *_ = ask(client, "Describe it briefly.", video=video)
    thread.join(timeout=120)
    assert results["cancelled"].finish_reason == "cancelled" and cached > 0
    assert_same_or_tie(result.token_ids, *server_request_reference(*hf, "Describe it briefly.", N, video=video))
    m = wait_for_idle_pools(server)
    assert m["unifiedserve_kv_pages_free"] == m["unifiedserve_kv_pages_total"]  # idle cached pages count as free
