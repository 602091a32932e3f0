"""The peer benchmark's harness (bench/peer) against the real server with the tiny model, through the OpenAI API:
its scenarios run, every request's tokens and usage are recorded, and summary.json has exactly the issues' keys.
Small inputs (10-frame videos, four 160x90 images) keep it short; no speed is judged here. The cache scenarios
(issue 21) run through a server without a prefix cache: their hit rates read None, their TTFTs are there."""
from __future__ import annotations

import asyncio
import json

import pytest

from bench.peer import prefix_cache, scenarios
from bench.peer.load import Target, open_loop
from bench.peer.summary import write_summary
from bench.serve_bench import SMOKE_SETUP
from bench.common import write
from tests.e2e.conftest import settled
from tests.e2e.test_openai_api import MODEL, _api
from tests.media import make_image, make_video

pytestmark = pytest.mark.e2e
SUMMARY_KEYS = {
    "video": {"ttft_ms"},
    "mixed_video": {"text_only_tbt_p99_ms", "text_tbt_window_p99_ms", "text_tbt_window_max_ms", "video_ttft_ms",
                    "text_ttft_window_max_ms", "text_tokens_window_per_s", "text_tbt_window_ratio"},
    "mixed_images": {"text_only_tbt_p99_ms", "text_tbt_window_p99_ms", "image_ttft_max_ms", "text_ttft_window_max_ms",
                     "text_tokens_window_per_s", "text_tbt_window_ratio"},
    "goodput": {"long_video", "video", "images", "multiturn"},
    "text_c1": {"ttft_ms", "tbt_mean_ms"},
    "text_c32": {"ttft_p50_ms", "tbt_mean_ms", "tbt_p99_ms"},
    "text_c32_structured": {"ttft_p50_ms", "tbt_mean_ms", "tbt_p99_ms"},
    "images16": {"ttft_p50_ms", "ttft_max_ms"},
    "followup": {"ttft_ms", "first_ttft_ms", "chat_ttft_ms"},
    "multiturn": {"prefix_hit_rate", "reusable_hit_rate", "first_ttft_p50_ms", "first_ttft_p90_ms",
                  "later_ttft_p50_ms", "later_ttft_p90_ms", "slo_attainment", "ttft_reference_ms",
                  "slo_attainment_by_ttft_factor"},
}


@pytest.fixture(scope="module")
def target(server, tmp_path_factory):
    with _api(server.ports.grpc, tmp_path_factory.mktemp("peer") / "api.log") as api:
        yield Target("unifiedserve", api.url, MODEL)


@pytest.fixture(scope="module")
def inputs(media_dir):
    video = media_dir / "peer_clip.mp4"
    make_video(video, width=64, height=48, num_frames=10)
    images = []
    for k in range(4):
        images.append(media_dir / f"peer_{k}.jpg")
        images[-1].write_bytes(make_image(160 + 16 * k, 90, "RGB", "JPEG"))
    clips = []
    for k in range(3):  # distinct lengths: distinct clips
        clips.append(media_dir / f"peer_clip_{k}.mp4")
        make_video(clips[-1], width=64, height=48, num_frames=8 + 2 * k)
    return scenarios.Inputs(SMOKE_SETUP, video, video, tuple(images), {(160, 90): tuple(images[:2])}, video,
                            tuple(clips))


def test_the_warm_up_burst_sends_its_requests_at_once_and_each_is_served(target, inputs):
    """``start``'s second warm-up: every request of the burst sent together (so that each API process meets one)."""
    records = asyncio.run(open_loop(target, scenarios.warmup_burst(inputs)))
    assert len(records) == scenarios.WARMUP_BURST == 32
    assert [(r.error, r.output_tokens) for r in records] == [(None, 4)] * 32
    # every one sent before any had been answered (one after another, each would wait for the last to end); a
    # bound on the send times instead would also measure how fast a loaded machine's event loop runs
    assert max(r.sent_s for r in records) < min(r.sent_s + r.done_s for r in records)


def test_scenarios_record_every_token_and_the_summary_has_the_issues_keys(server, target, inputs, tmp_path):
    names = ["text_c1", "images16", "video", "mixed_images", "goodput_images@unloaded", "goodput_images@1",
             "followup", "multiturn"]
    state = {"argv": ["--metrics-port", str(server.ports.metrics)], "url": target.url}  # as bench.peer.servers keeps
    by_name = {}

    def counters() -> dict[str, float] | None:
        return prefix_cache.read("unifiedserve", state)
    for name in names:
        # the orchestrator sends its counters once a second (FLUSH_S): around a cache scenario, wait for the last ones
        before = settled(counters) if name in scenarios.CACHED else counters()
        records = asyncio.run(scenarios.run(name, target, inputs, requests=3, questions=3, streams=2))
        assert records and all(r.error is None for r in records), [r.error for r in records]
        for r in records:  # ignore_eos: every requested token arrives, each with its own arrival time
            assert r.output_tokens == len(r.token_s) > 0 and r.prompt_tokens > 0
        by_name[name] = records
        after = settled(counters) if name in scenarios.CACHED else counters()
        write(tmp_path / "raw" / "unifiedserve", name.replace("@", "_at_"),
              {"system": "unifiedserve", "scenario": name, "date": "today", "device": "cpu", "versions": {},
               "server_version": None, "records": [r.to_json() for r in records],
               "prefix_cache": prefix_cache.increase(before, after)})
    first, alone, chat = by_name["followup"]
    assert (first.kind, alone.kind, chat.kind) == ("first", "followup", "followup_chat")
    assert first.sent_s + first.done_s <= alone.sent_s  # the follow-up waits for the first answer
    assert chat.prompt_tokens > first.prompt_tokens + 20  # the first question, the answer and the new question
    asked = {}
    for r in by_name["multiturn"]:  # a clip's questions one after another, in order
        clip, _, question = r.kind.partition("_q")
        assert int(question) == len(asked.setdefault(clip, []))
        assert not asked[clip] or asked[clip][-1].sent_s + asked[clip][-1].done_s <= r.sent_s
        asked[clip].append(r)
    assert {clip: len(v) for clip, v in asked.items()} == {"clip0": 3, "clip1": 3, "clip2": 3}
    summary = json.loads(write_summary(tmp_path).read_text())
    assert set(summary) == {"date", "device", "model", "versions", "systems"}
    figures = summary["systems"]["unifiedserve"]
    assert {name: set(values) for name, values in figures.items()} == SUMMARY_KEYS
    assert figures["images16"]["ttft_max_ms"] > 0 and figures["text_c1"]["tbt_mean_ms"] > 0
    assert figures["video"]["ttft_ms"] > 0 and figures["mixed_images"]["image_ttft_max_ms"] > 0
    assert figures["mixed_images"]["text_tbt_window_p99_ms"] is not None  # the streams decoded beside the images
    assert figures["mixed_images"]["text_tokens_window_per_s"] > 0
    assert figures["goodput"]["images"]["max_rate_rps"] in (None, 1.0)
    assert figures["followup"]["ttft_ms"] > 0 and figures["followup"]["chat_ttft_ms"] > 0
    assert figures["multiturn"]["later_ttft_p90_ms"] > 0 and 0 <= figures["multiturn"]["slo_attainment"] <= 1
    # the session's server has its prefix cache on (the default): later questions about a clip hit it
    assert 0 < figures["multiturn"]["prefix_hit_rate"] <= 1 and 0 < figures["multiturn"]["reusable_hit_rate"] <= 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["systems"]["unifiedserve"]["goodput"]["images"]["best_unloaded_ttft_ms"]) == {"1x160x90",
                                                                                                     "2x160x90"}
