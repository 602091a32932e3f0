"""The peer benchmark's cache scenarios (issue 21) on hand-made records: the follow-up's and the multiturn scenario's
figures (bench/peer/figures.py), the prefix-cache counters (bench/peer/prefix_cache.py), the requests they send
(bench/peer/scenarios.py), vLLM's command with its caches on (bench/peer/servers.py) and summary.json's keys."""
from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time
from pathlib import Path

import pytest

from bench.common import write
from bench.peer import figures, load, prefix_cache, scenarios, servers
from bench.peer.load import ChatRequest, RequestRecord, Target
from bench.peer.summary import write_summary
from bench.serve_bench import SMOKE_SETUP
from tests.unit.bench.test_peer_figures import record

VLLM_METRICS = """# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1200.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 800.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e+09
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 900.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 100.0
vllm:num_requests_running{engine="0",model_name="m"} 2.0
"""


def multiturn_records(ttfts_s: list[list[float]], prompt_tokens: int = 1000, cached: int | None = 900
                      ) -> list[dict]:
    """Per clip, its questions' records with these TTFTs (s), 10 ms apart tokens; later questions report ``cached``
    of their prompt tokens found cached (first ones none)."""
    return [{**record(f"clip{k}_q{j}", 0.0, ttft, 0.01), "prompt_tokens": prompt_tokens,
             "cached_tokens": cached if j else 0}
            for k, clip in enumerate(ttfts_s) for j, ttft in enumerate(clip)]


def test_followup_figures_are_the_follow_ups_ttft_beside_the_first_and_the_chats():
    records = [record("first", 0.0, 17.7, 0.01), record("followup", 18.0, 0.3, 0.01),
               record("followup_chat", 19.0, 0.4, 0.01)]
    assert figures.scenario_figures("followup", records) == pytest.approx(
        {"ttft_ms": 300.0, "first_ttft_ms": 17700.0, "chat_ttft_ms": 400.0})
    failed = {**record("followup", 18.0, 0.3, 0.01), "error": "HTTP 500"}
    assert figures.scenario_figures("followup", [records[0], failed])["ttft_ms"] is None
    assert figures.scenario_figures("followup", []) == dict.fromkeys(("ttft_ms", "first_ttft_ms", "chat_ttft_ms"))


def test_multiturn_hit_rates_are_hits_over_queries_and_the_later_questions_cached_share():
    records = multiturn_records([[1.0, 0.1, 0.2], [2.0, 0.1, 0.3]])  # 4 later questions of 1000 tokens, 900 cached
    m = figures.scenario_figures("multiturn", records, {"queries": 6000.0, "hits": 3600.0})
    assert m["prefix_hit_rate"] == pytest.approx(0.6) and m["reusable_hit_rate"] == pytest.approx(0.9)
    unreported = figures.scenario_figures("multiturn", multiturn_records([[1.0, 0.1]], cached=None))
    assert unreported["reusable_hit_rate"] is None  # a server that does not say what it found cached
    assert m["first_ttft_p50_ms"] == pytest.approx(1500.0) and m["first_ttft_p90_ms"] == pytest.approx(1900.0)
    assert m["later_ttft_p50_ms"] == pytest.approx(150.0) and m["later_ttft_p90_ms"] == pytest.approx(270.0)
    assert m["slo_attainment"] == 1.0  # every TTFT within 2 x the fastest first question (1 s)


def test_multiturn_slo_takes_the_fastest_first_question_as_every_questions_reference():
    records = multiturn_records([[1.0, 0.1], [2.5, 0.1]])
    records.append({**record("clip2_q0", 0.0, 0.5, [0.01] * 10 + [0.3]), "prompt_tokens": 1000})  # a 300 ms stall
    # the reference: clip2's 0.5 s; 1.0 s is within 2x, 2.5 s is not, nor is the stall's TBT p99
    assert figures.scenario_figures("multiturn", records)["slo_attainment"] == pytest.approx(3 / 5)


def test_multiturn_hit_rates_are_none_without_counters_or_lookups_and_nothing_is_none_when_not_run():
    records = multiturn_records([[1.0, 0.1]])
    for counters in (None, {"queries": 0.0, "hits": 0.0}):
        m = figures.scenario_figures("multiturn", records, counters)
        assert m["prefix_hit_rate"] is None and m["later_ttft_p50_ms"] == pytest.approx(100.0)
    assert figures.scenario_figures("multiturn", records, {"queries": 5.0, "hits": 0.0})["prefix_hit_rate"] == 0.0
    assert set(figures.scenario_figures("multiturn", []).values()) == {None}
    failed = [{**r, "error": "HTTP 500", "token_s": [], "ttft_ms": None} for r in records]
    assert figures.scenario_figures("multiturn", failed)["slo_attainment"] is None


def test_prefix_counters_are_summed_over_engines_and_absent_ones_read_none():
    names = prefix_cache.COUNTERS["vllm"]
    assert prefix_cache.parse(VLLM_METRICS, names) == {names[0]: 2000.0, names[1]: 1000.0}
    served = [VLLM_METRICS]

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = served[0].encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics) as httpd:
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        state = {"url": f"http://127.0.0.1:{httpd.server_address[1]}", "argv": ["vllm"]}
        before = prefix_cache.read("vllm", state)
        assert before == {"queries": 2000.0, "hits": 1000.0}
        served[0] = VLLM_METRICS.replace("} 900.0", "} 1500.0")
        assert prefix_cache.increase(before, prefix_cache.read("vllm", state)) == {"queries": 0.0, "hits": 600.0}
        assert prefix_cache.read("unifiedserve", {"argv": ["--metrics-port", str(httpd.server_address[1])]}) is None
        httpd.shutdown()
    assert prefix_cache.increase(None, before) is None


def inputs(tmp_path: Path, clips: int) -> scenarios.Inputs:
    video = tmp_path / "v.mp4"
    return scenarios.Inputs(SMOKE_SETUP, video, video, (), {}, tmp_path / "f.mp4",
                            tuple(tmp_path / f"c{k}.mp4" for k in range(clips)))


def test_multiturn_sessions_ask_each_clip_its_questions_in_order(tmp_path):
    sessions = scenarios.multiturn_sessions(inputs(tmp_path, 2), 3)
    assert [[r.kind for r in s] for s in sessions] == [["clip0_q0", "clip0_q1", "clip0_q2"],
                                                       ["clip1_q0", "clip1_q1", "clip1_q2"]]
    body = sessions[1][2].body("m")
    assert [m["role"] for m in body["messages"]] == ["user"]
    video, text = body["messages"][0]["content"]
    assert video["video_url"]["url"].endswith("c1.mp4") and text["text"] == scenarios.QUESTIONS[2]
    with pytest.raises(ValueError):
        scenarios.multiturn_sessions(inputs(tmp_path, 2), len(scenarios.QUESTIONS) + 1)


def test_distinct_videos_differ_only_in_bit_rate(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(scenarios, "build_video", lambda media, name, spec: built.append((name, spec)) or media)
    scenarios.distinct_video(tmp_path, ("libx264", 1280, 720, 3_000_000, "medium", 1 / 3), 2)
    assert built == [("bunny_720p_20s_3016k", ("libx264", 1280, 720, 3_016_000, "medium", 1 / 3))]


def test_both_systems_start_with_their_caches_off_unless_asked():
    plain, _ = servers.command("unifiedserve", Path("ckpt"), Path("media"), False, [])
    cached, _ = servers.command("unifiedserve", Path("ckpt"), Path("media"), False, [], caches=True)
    off = ("orchestrator.prefix_caching=false", "orchestrator.encoder_cache_tokens=0")
    assert all(a in plain and a not in cached for a in off)
    plain, _ = servers.command("vllm", Path("ckpt"), Path("media"), False, [])
    cached, _ = servers.command("vllm", Path("ckpt"), Path("media"), False, [], caches=True)
    assert "--no-enable-prefix-caching" in plain and plain[plain.index("--mm-processor-cache-gb") + 1] == "0"
    assert "--no-enable-prefix-caching" not in cached and "--mm-processor-cache-gb" not in cached
    assert [a for a in plain if a not in cached] == ["--no-enable-prefix-caching", "--mm-processor-cache-gb", "0"]
    assert [a for a in cached if a not in plain] == ["--enable-prompt-tokens-details"]


def test_summary_gains_the_cache_scenarios_figures_and_their_ratio(tmp_path):
    for system, hits in (("unifiedserve", 3600.0), ("vllm", 1800.0)):
        for name, records, counters in (
                ("followup", [record("first", 0, 17.0, 0.01), record("followup", 18, 0.2, 0.01)], None),
                ("multiturn", multiturn_records([[1.0, 0.1, 0.2], [2.0, 0.1, 0.3]]),
                 {"queries": 6000.0, "hits": hits})):
            write(tmp_path / "raw" / system, name,
                  {"system": system, "scenario": name, "date": "2026-12-03", "device": "H200", "versions": {},
                   "server_version": "v", "records": records, "prefix_cache": counters, "server_argv": ["x"]})
    summary = json.loads(write_summary(tmp_path).read_text())
    ours = summary["systems"]["unifiedserve"]
    assert ours["followup"]["ttft_ms"] == pytest.approx(200.0) and ours["followup"]["chat_ttft_ms"] is None
    assert ours["multiturn"]["prefix_hit_rate"] == pytest.approx(0.6)
    assert summary["systems"]["vllm"]["multiturn"]["prefix_hit_rate"] == pytest.approx(0.3)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["unifiedserve_over_vllm"]["multiturn"]["prefix_hit_rate"] == 2.0
    assert ours["multiturn"]["ttft_reference_ms"] == pytest.approx(1000.0)
    scenario = report["systems"]["vllm"]["scenarios"]["multiturn"]
    assert scenario["prefix_cache"] == {"queries": 6000.0, "hits": 1800.0} and scenario["server_argv"] == ["x"]
    assert "prefix_cache" not in report["systems"]["vllm"]["scenarios"]["followup"]


def test_the_cache_scenarios_media_are_built_only_when_asked_for(tmp_path, monkeypatch):
    monkeypatch.setattr(scenarios, "build_media", lambda media, setup: (media / "v.mp4", [media / "i.jpg"]))
    monkeypatch.setattr(scenarios, "_resized", lambda path, size: path)
    monkeypatch.setattr(scenarios, "distinct_video", _never_built)
    plain = scenarios.build_inputs(tmp_path, smoke=True, clips=2, cache_media=False)
    assert plain.followup_video is None and plain.clips == ()
    monkeypatch.setattr(scenarios, "distinct_video", _named_by_rate_step)  # called in the build's worker processes
    cached = scenarios.build_inputs(tmp_path, smoke=True, clips=2)
    assert cached.followup_video == tmp_path / "1.mp4" and cached.clips == (tmp_path / "2.mp4", tmp_path / "3.mp4")


def _never_built(media: Path, spec: tuple, k: int) -> Path:
    raise AssertionError("a cache scenario's video was built unasked")


def _named_by_rate_step(media: Path, spec: tuple, k: int) -> Path:
    return media / f"{k}.mp4"


def test_both_systems_multiturn_slo_takes_the_fastest_first_question_of_either_as_reference(tmp_path):
    # ours: first questions 1.0 and 1.5 s; theirs 2.5 and 3.0 s. Each against its own fastest, both meet every SLO;
    # against the shared 1.0 s (2 s limit) all of ours do and neither of their first questions does.
    for system, firsts in (("unifiedserve", (1.0, 1.5)), ("vllm", (2.5, 3.0))):
        write(tmp_path / "raw" / system, "multiturn",
              {"system": system, "scenario": "multiturn", "date": "2026-12-03", "device": "H200", "versions": {},
               "server_version": "v", "records": multiturn_records([[t, 0.1] for t in firsts])})
    systems = json.loads(write_summary(tmp_path).read_text())["systems"]
    assert systems["unifiedserve"]["multiturn"]["slo_attainment"] == 1.0
    assert systems["vllm"]["multiturn"]["slo_attainment"] == pytest.approx(0.5)
    assert systems["vllm"]["multiturn"]["slo_attainment_by_ttft_factor"]["3.0x"] == 1.0
    assert [s["multiturn"]["ttft_reference_ms"] for s in systems.values()] == pytest.approx([1000.0, 1000.0])


def test_multiturn_goodput_clip_sets_are_the_unloaded_pass_and_each_rate_on_clips_of_their_own():
    sets = scenarios.goodput_clip_sets(3)
    rates = scenarios.GOODPUT_RATES["multiturn"]
    assert list(sets) == ["unloaded", *map(str, rates)]
    assert len(sets["unloaded"]) == scenarios.UNLOADED_REPEATS and all(len(sets[str(r)]) == 3 for r in rates)
    steps = [k for ks in sets.values() for k in ks]
    assert len(set(steps)) == len(steps) and max(steps) < 0  # the follow-up's and multiturn's steps are 1 and up


def test_the_multiturn_goodput_clips_are_built_only_when_asked_for_and_typed_first_or_later(tmp_path, monkeypatch):
    monkeypatch.setattr(scenarios, "build_media", lambda media, setup: (media / "v.mp4", [media / "i.jpg"]))
    monkeypatch.setattr(scenarios, "_resized", lambda path, size: path)
    monkeypatch.setattr(scenarios, "distinct_video", _named_by_rate_step)
    assert scenarios.build_inputs(tmp_path, smoke=True, cache_media=False).goodput_clips == {}
    built = scenarios.build_inputs(tmp_path, smoke=True, cache_media=False, goodput_sessions=2)
    rate = str(scenarios.GOODPUT_RATES["multiturn"][1])
    assert built.goodput_clips[rate] == (tmp_path / "-5.mp4", tmp_path / "-6.mp4")  # after unloaded's 2, rate 1's 2
    sessions = scenarios.multiturn_sessions(built, 3, built.goodput_clips[rate], by_type=True)
    assert [[r.kind for r in s] for s in sessions] == [["first_question", "later_question", "later_question"]] * 2


def test_open_loop_sends_a_sessions_questions_one_after_another_from_its_arrival(monkeypatch):
    events = []

    async def fake_send(client, target, request, start):  # each request takes 0.2 s
        events.append(("sent", request.kind, time.perf_counter() - start))
        await asyncio.sleep(0.2)
        events.append(("ended", request.kind, time.perf_counter() - start))
        return RequestRecord(request.kind, 0.0)

    monkeypatch.setattr(load, "send", fake_send)
    a = tuple(ChatRequest(f"a{j}", (), 1) for j in range(3))
    b = (ChatRequest("b0", (), 1),)
    records = asyncio.run(load.open_loop(Target("s", "http://127.0.0.1:1", "m"), [(0.0, a), (0.3, b)]))
    assert [r.kind for r in records] == ["a0", "a1", "a2", "b0"]
    # a's questions in turn, each once the last has ended; b at its arrival (0.3 s), between a1's and a2's sends
    assert [(e, k) for e, k, _ in events if k != "b0"] == [("sent", "a0"), ("ended", "a0"), ("sent", "a1"),
                                                           ("ended", "a1"), ("sent", "a2"), ("ended", "a2")]
    sent = [k for e, k, _ in events if e == "sent"]
    assert sent == ["a0", "a1", "b0", "a2"] and [t for e, k, t in events if k == "b0"][0] >= 0.3


def test_a_multiturn_goodput_rate_without_clips_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no clips for 'goodput_multiturn@0.3'"):
        asyncio.run(scenarios.run("goodput_multiturn@0.3", Target("s", "http://127.0.0.1:1", "m"),
                                  inputs(tmp_path, 1)))
