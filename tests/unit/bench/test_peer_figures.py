"""The peer benchmark's pure parts: SLO attainment and goodput (bench/peer/slo.py), the scenarios' window figures
(bench/peer/figures.py), Poisson arrivals (bench/peer/load.py), summary.json and report.json (bench/peer/summary.py),
the cross-check's metrics (bench/peer/crosscheck.py), all on hand-made request records."""
from __future__ import annotations

import json

import pytest

from bench.common import write
from bench.peer import figures, slo
from bench.peer.crosscheck import our_metrics
from bench.peer.load import RequestRecord, poisson_times
from bench.peer.summary import median_figures, raw_stem, write_summary
from bench.peer.timelines import gap_phases, gap_places, steps_of, token_gaps, ttft_parts


def record(kind: str, sent_s: float, ttft_s: float, gap_s: float | list[float], tokens: int = 5,
           error: str | None = None) -> dict:
    """A request sent at ``sent_s`` whose first token came ``ttft_s`` later and the rest ``gap_s`` apart."""
    gaps = gap_s if isinstance(gap_s, list) else [gap_s] * (tokens - 1)
    times = [ttft_s]
    for gap in gaps:
        times.append(times[-1] + gap)
    return RequestRecord(kind, sent_s, times, prompt_tokens=10, output_tokens=len(times), error=error).to_json()


def test_a_request_meets_its_slos_within_the_ttft_factor_and_the_tbt_p99():
    best = {"video": 1000.0}
    assert slo.meets_slo(record("video", 0, 1.9, 0.01), best)  # 1.9 s <= 2 x 1 s; TBT 10 ms
    assert not slo.meets_slo(record("video", 0, 2.1, 0.01), best)  # TTFT over 2x
    assert slo.meets_slo(record("video", 0, 2.1, 0.01), best, factor=3.0)
    assert not slo.meets_slo(record("video", 0, 1.0, [0.01] * 10 + [0.2]), best)  # one 200 ms stall: p99 > 50 ms
    assert not slo.meets_slo(record("video", 0, 1.0, 0.01, error="HTTP 500"), best)
    assert slo.meets_slo(record("video", 0, 1.0, [], tokens=1), best)  # one token: no TBT to judge
    with pytest.raises(KeyError):
        slo.meets_slo(record("image", 0, 1.0, 0.01), best)


def test_best_unloaded_ttft_is_the_lowest_per_kind_among_successes():
    records = [record("1x640x360", 0, 0.30, 0.01), record("1x640x360", 1, 0.25, 0.01),
               record("2x640x360", 2, 0.40, 0.01), record("2x640x360", 3, 0.10, 0.01, error="HTTP 500")]
    assert slo.best_unloaded_ttft(records) == pytest.approx({"1x640x360": 250.0, "2x640x360": 400.0})


def test_goodput_is_the_highest_rate_with_90_percent_attainment():
    best = {"text": 100.0}
    good, late = record("text", 0, 0.1, 0.01), record("text", 0, 0.5, 0.01)
    runs = {1.0: [good] * 10, 2.0: [good] * 9 + [late], 4.0: [good] * 8 + [late] * 2, 8.0: [late] * 10}
    by_rate = {rate: slo.attainment(records, best) for rate, records in runs.items()}
    assert by_rate == {1.0: 1.0, 2.0: 0.9, 4.0: 0.8, 8.0: 0.0}
    assert slo.goodput(by_rate) == 2.0
    assert slo.goodput({1.0: 0.5, 2.0: None}) is None
    table = slo.attainment_table(runs, best)
    assert table["2.0x"] == {"1.0": 1.0, "2.0": 0.9, "4.0": 0.8, "8.0": 0.0}
    assert table["5.0x"]["8.0"] == 1.0  # 500 ms is within 5 x 100 ms


def test_mixed_window_takes_the_text_gaps_between_the_burst_and_its_first_token():
    text = record("text", 0.0, 0.1, [0.01] * 45 + [0.5] + [0.02] * 5)  # the 500 ms gap ends at 1.05 s
    video = record("video", 0.2, 0.4, 0.01)  # sent at 0.2 s, first token at 0.6 s: window [0.2, 0.6]
    m = figures.scenario_figures("mixed_video", [video, text])
    assert m["video_ttft_ms"] == pytest.approx(400.0)
    assert m["text_tbt_window_max_ms"] == pytest.approx(10.0)  # the stall ends after the window
    assert m["text_only_tbt_p99_ms"] == pytest.approx(10.0)
    assert m["text_tbt_window_ratio"] == pytest.approx(1.0)  # the window's p99 over the text-only p99
    late_video = record("video", 0.2, 1.0, 0.01)  # first token at 1.2 s: the stall is inside
    assert figures.scenario_figures("mixed_video", [late_video, text])["text_tbt_window_max_ms"] == pytest.approx(500.0)


def test_a_text_request_that_waits_behind_the_burst_shows_its_stall_as_ttft():
    video = record("video", 2.0, 20.0, 0.01)  # window [2, 22] s
    running = record("text", 1.9, 0.02, 0.005, tokens=20)  # ends before the stall: its gaps are all 5 ms
    waiting = record("text", 2.1, 18.0, 0.005)  # sent in the window, first token 18 s later
    before = record("text", 0.0, 0.3, 0.005)  # sent before the window: not counted
    m = figures.scenario_figures("mixed_video", [video, running, waiting, before])
    assert m["text_tbt_window_max_ms"] == pytest.approx(5.0) and m["text_ttft_window_max_ms"] == pytest.approx(18000.0)
    assert m["text_tokens_window_per_s"] == pytest.approx((4 + 5) / 20.0)  # running: 4 tokens after 2 s; waiting: 5


def test_figures_are_none_where_a_scenario_was_not_run_or_its_burst_failed():
    assert figures.scenario_figures("mixed_images", []) == {
        "text_only_tbt_p99_ms": None, "text_tbt_window_p99_ms": None, "text_tbt_window_ratio": None,
        "text_ttft_window_max_ms": None, "text_tokens_window_per_s": None, "image_ttft_max_ms": None}
    failed = [record("image", 0.2, 0.3, 0.01), {**record("image", 0.2, 0.3, 0.01), "token_s": [], "ttft_ms": None,
                                                 "error": "HTTP 500"}, record("text", 0, 0.1, 0.01, tokens=50)]
    assert figures.scenario_figures("mixed_images", failed)["image_ttft_max_ms"] is None
    assert set(figures.scenario_figures("text_c32", [])) == {"ttft_p50_ms", "tbt_mean_ms", "tbt_p99_ms"}


def test_short_request_figures():
    images = [record("image", 0, 0.1 * (k + 1), 0.01) for k in range(16)]
    m = figures.scenario_figures("images16", images)
    assert m["ttft_max_ms"] == pytest.approx(1600.0) and m["ttft_p50_ms"] == pytest.approx(850.0)
    c1 = figures.scenario_figures("text_c1", [record("text", 0, 0.05, [0.004, 0.006])])
    assert c1 == pytest.approx({"ttft_ms": 50.0, "tbt_mean_ms": 5.0})
    repeated = [record("text", 2 * k, ttft, 0.005) for k, ttft in enumerate((0.03, 0.12, 0.02, 0.05, 0.04))]
    assert figures.scenario_figures("text_c1", repeated)["ttft_ms"] == pytest.approx(40.0)  # the median, not the max
    streams = [record("text", 0, 0.1, 0.005) for _ in range(4)]
    assert figures.scenario_figures("text_c32_structured", streams) == figures.scenario_figures("text_c32", streams)


def test_the_structured_scenarios_rule_is_taken_and_no_256_token_reply_completes_it():
    """What text_c32_structured sends as structured_outputs passes the orchestrator's check (vLLM takes the same
    regex), and its fixed length outruns a 256-token reply of at most 31 characters a token."""
    from bench.peer.scenarios import STRUCTURED
    from orchestrator.sampling_params import parse_sampling_parameters

    spec = parse_sampling_parameters(json.dumps({"structured_outputs": STRUCTURED})).structured_outputs
    assert spec.kind == "regex" and int(spec.text.rsplit("{", 1)[1].rstrip("}")) > 256 * 31


def test_a_passes_figures_fit_one_line():
    c1 = [record("text", 0, 0.05, [0.004, 0.006])]
    assert figures.figures_line("text_c1", c1) == "ttft_ms 50.00, tbt_mean_ms 5.00"
    assert figures.figures_line("images16", []) == ""  # not computed: left out
    assert figures.figures_line("goodput_video@0.04", c1) == ""  # no summary figures of its own


def test_poisson_arrivals_are_seeded_and_at_the_rate():
    times = poisson_times(4.0, 4000, seed=3)
    assert times == poisson_times(4.0, 4000, seed=3) and times != poisson_times(4.0, 4000, seed=4)
    assert times[0] == 0.0 and all(b > a for a, b in zip(times, times[1:]))
    assert len(times) / times[-1] == pytest.approx(4.0, rel=0.05)


def test_summary_of_two_systems_holds_the_issues_keys_goodput_and_the_prompt_token_check(tmp_path):
    lag = {"ticks": 900, "lag_p99_ms": 1.2, "lag_max_ms": 9.0, "stalled_ms": 9.0, "stalls": [[10.0, 9.0]]}

    def raw(system: str, scenario: str, records: list[dict]) -> None:
        write(tmp_path / "raw" / system, scenario.replace("@", "_at_"),
              {"system": system, "scenario": scenario, "date": "2026-12-01", "device": "H200", "versions": {},
               "server_version": "v", "records": records, "client_loop": lag})

    for system, prompt in (("unifiedserve", 10), ("vllm", 11)):
        raw(system, "text_c1", [{**record("text", 0, 0.02, 0.005), "prompt_tokens": prompt}])
        # vLLM's unloaded video at 2 s would pass its 3-s requests at 0.2 req/s; the shared reference is ours, 1 s
        raw(system, "goodput_video@unloaded", [record("video", 0, 1.0 if system == "unifiedserve" else 2.0, 0.01)])
        raw(system, "goodput_video@0.1", [record("video", k, 1.5, 0.01) for k in range(10)])
        raw(system, "goodput_video@0.2", [record("video", k, 1.5 if k < 8 else 3.0, 0.01) for k in range(10)])
    summary = json.loads(write_summary(tmp_path).read_text())
    assert set(summary) == {"date", "device", "versions", "model", "systems"} and summary["model"] is None
    assert summary["versions"] == {"unifiedserve": "v", "vllm": "v"}
    for figures_of in summary["systems"].values():
        assert figures_of["text_c1"] == pytest.approx({"ttft_ms": 20.0, "tbt_mean_ms": 5.0})
        assert figures_of["goodput"] == {"long_video": {"max_rate_rps": None}, "video": {"max_rate_rps": 0.1},
                                         "images": {"max_rate_rps": None}, "multiturn": {"max_rate_rps": None}}
        assert figures_of["video"] == {"ttft_ms": None}
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["prompt_tokens_agree"] == {"goodput_video@0.1": True, "goodput_video@0.2": True,
                                             "goodput_video@unloaded": True, "text_c1": False}
    assert (tmp_path / "attainment_video.png").exists()
    lag.pop("stalls")  # the report gives the load generator's loop lag without its stalls
    assert report["systems"]["vllm"]["scenarios"]["text_c1"]["client_loop"] == lag
    assert report["unifiedserve_over_vllm"]["text_c1"] == {"ttft_ms": 1.0, "tbt_mean_ms": 1.0}
    assert report["unifiedserve_over_vllm"]["goodput"] == {"video.max_rate_rps": 1.0}  # None (not run) has no ratio
    assert report["systems"]["vllm"]["goodput"]["video"]["best_unloaded_ttft_ms"] == {"video": pytest.approx(1000.0)}
    own = report["systems"]["vllm"]["goodput"]["video"]["own_reference"]  # its own 2 s: 3-s requests pass too
    assert own["max_rate_rps"] == 0.2 and own["best_unloaded_ttft_ms"] == {"video": pytest.approx(2000.0)}


def test_a_fixed_scenario_run_in_passes_has_each_figures_median_in_the_summary_and_every_pass_in_the_report(tmp_path):
    """``run.py --passes 3``: ``text_c1.json``, ``text_c1.pass2.json``, ``text_c1.pass3.json``; the summary takes the
    median of each figure over them (here the TTFT of one pass and the TBT of another), the report every pass's, with
    each pass's load-generator loop lag (stalls left out)."""
    for index, (ttft_s, gap_s) in enumerate(((0.030, 0.005), (0.010, 0.007), (0.020, 0.004)), start=1):
        write(tmp_path / "raw" / "unifiedserve", raw_stem("text_c1", index),
              {"system": "unifiedserve", "scenario": "text_c1", "pass": index, "date": "d", "device": "H200",
               "versions": {}, "server_version": "v", "records": [record("text", 0, ttft_s, gap_s)],
               "client_loop": {"ticks": 100 * index, "lag_p99_ms": 1.0, "stalls": [[1.0, 3.0]]}})
    summary = json.loads(write_summary(tmp_path).read_text())
    assert summary["systems"]["unifiedserve"]["text_c1"] == pytest.approx({"ttft_ms": 20.0, "tbt_mean_ms": 5.0})
    report = json.loads((tmp_path / "report.json").read_text())
    passes = report["systems"]["unifiedserve"]["passes"]["text_c1"]
    assert [p["figures"] for p in passes] == [
        pytest.approx({"ttft_ms": 30.0, "tbt_mean_ms": 5.0}), pytest.approx({"ttft_ms": 10.0, "tbt_mean_ms": 7.0}),
        pytest.approx({"ttft_ms": 20.0, "tbt_mean_ms": 4.0})]
    assert [(p["requests"], p["errors"]) for p in passes] == [(1, 0)] * 3
    assert [p["client_loop"] for p in passes] == [{"ticks": 100 * k, "lag_p99_ms": 1.0} for k in (1, 2, 3)]
    assert report["systems"]["unifiedserve"]["scenarios"]["text_c1"]["requests"] == 1  # the first pass's


def test_a_figure_a_pass_lacks_has_no_median():
    assert median_figures([{"ttft_ms": 1.0, "x": None}, {"ttft_ms": 3.0, "x": 2.0}]) == {"ttft_ms": 2.0, "x": None}
    assert raw_stem("goodput_video@0.04") == "goodput_video_at_0.04" and raw_stem("video", 2) == "video.pass2"


def test_crosscheck_computes_vllm_bench_serves_metrics_from_our_records():
    fast = RequestRecord("text", 0.0, [0.1, 0.11, 0.12, 0.13])  # TTFT 100 ms, TPOT 10 ms
    slow = RequestRecord("text", 0.0, [0.3, 0.32, 0.34, 0.36])  # TTFT 300 ms, TPOT 20 ms
    failed = RequestRecord("text", 0.0, error="HTTP 500")
    m = our_metrics([fast, slow, failed])
    assert m["completed"] == 2
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_tpot_ms"] == pytest.approx(15.0)
    assert m["mean_itl_ms"] == pytest.approx(15.0) and m["p99_tpot_ms"] == pytest.approx(19.9)


def test_steps_are_rebuilt_from_the_requests_shares_and_count_the_requests_decoding():
    def step(launched_ms, worker_ms, patches, tokens):
        return {"event": "step", "ms": launched_ms + worker_ms, "launched_ms": launched_ms, "worker_ms": worker_ms,
                "encode_groups": int(patches > 0), "encode_patches": patches, "prefill_tokens": tokens}

    a = {**record("image", 0.0, 0.3, 0.01), "timeline": {"events": [
        {**step(10, 100, 4784, 1024), "encode_ms": 30.0, "prefill_ms": 60.0}, step(110, 90, 0, 254)]}}
    b = {**record("image", 0.005, 0.5, 0.01),  # sent 5 ms later: the same steps at launched_ms 5 ms less
         "timeline": {"events": [step(5, 100, 4784, 1024), step(105, 90, 0, 1024), step(300, 80, 0, 254)]}}
    steps = steps_of([a, b])
    assert [(s["encode_patches"], s["prefill_tokens"], s["requests"]) for s in steps] == [
        (9568, 2048, 2), (0, 1278, 2), (0, 254, 1)]
    assert [s["decoding"] for s in steps] == [0, 0, 1]  # a's first token (0.3 s) came before the third step
    assert (steps[0]["encode_ms"], steps[0]["prefill_ms"]) == (30.0, 60.0) and "encode_ms" not in steps[1]


def test_ttft_parts_split_each_kinds_first_token_by_its_timeline():
    def timeline(sent_ms, added_ms, steps_ms, first_ms, chunk_ms):
        moments = [("api_received", -10.0), ("api_sent", sent_ms), ("parsed", 1.0), ("engine_added", added_ms),
                   ("first_token", first_ms), ("first_response", first_ms + 0.5), ("api_first_chunk", chunk_ms)]
        return {"events": [{"event": name, "ms": ms} for name, ms in moments]
                + [{"event": "step", "ms": s + 50, "launched_ms": s} for s in steps_ms]}

    # TTFT at the client 130 ms; the API's span from receiving to the first chunk 122 ms: 8 ms outside
    a = {**record("text", 0.0, 0.130, 0.01), "timeline": timeline(-6.0, 2.0, [20.0, 70.0], 100.0, 112.0)}
    b = {**record("text", 0.0, 0.250, 0.01), "timeline": timeline(-2.0, 4.0, [10.0], 200.0, 204.0)}
    no_timeline = record("text", 0.0, 0.1, 0.01)
    failed = {**record("image", 0.0, 0.1, 0.01, error="HTTP 500"), "ttft_ms": None,
              "timeline": timeline(-1.0, 1.0, [5.0], 50.0, 51.0)}
    parts = ttft_parts([a, b, no_timeline, failed])
    assert list(parts) == ["text"]
    text = parts["text"]
    assert text["api_to_orchestrator"] == {"p50_ms": 4.0, "max_ms": 6.0}
    assert text["admission"] == {"p50_ms": 3.0, "max_ms": 4.0}
    assert text["to_first_step"] == {"p50_ms": 12.0, "max_ms": 18.0}  # added at 2 and 4, first steps at 20 and 10
    assert text["steps"] == {"p50_ms": 135.0, "max_ms": 190.0}
    assert text["first_token_to_api"] == {"p50_ms": 8.0, "max_ms": 12.0}
    assert text["outside"]["p50_ms"] == pytest.approx(22.0) and text["outside"]["max_ms"] == pytest.approx(36.0)


def test_token_gaps_find_the_hop_where_each_large_gap_opened():
    """300 tokens 5 ms apart at every hop but three 30-ms gaps (the top 1%): before token 10 a slow decode step
    (every hop from decode's launch on), before token 20 a stalled send (from the send on), before token 30 the
    client alone."""
    n, opened_at = 300, {10: "decode_launched", 20: "sent", 30: "client"}
    hops = ["decode_launched", "decode_read", "received", "sent", "api_chunk", "client"]

    def times(hop: str) -> list[float]:  # token i's moment at ``hop`` (ms), from token 0 on
        at = [100.0]
        for i in range(1, n):
            late = i in opened_at and hops.index(hop) >= hops.index(opened_at[i])
            at.append(at[-1] + (30.0 if late else 5.0))
        return at

    rec = record("text", 0.0, 0.1, [(b - a) / 1e3 for a, b in zip(times("client"), times("client")[1:])])
    def us(at: list[float]) -> list[int]:  # the timeline's lists: whole µs
        return [round(t * 1e3) for t in at]

    tokens = {f"{hop}_us": us(times(hop)[1:]) for hop in hops[:3]}  # decode's: from the second token
    tokens |= {"sent_us": us(times("sent")[:-1]), "api_chunk_us": us(times("api_chunk"))}  # the last send: not in it
    tokens["decode_read_us"][5] = None  # a step decode did not time
    gaps = token_gaps([{**rec, "timeline": {"events": [], "tokens": tokens}}, record("text", 0.0, 0.1, 0.005)])
    assert gaps["gaps"] == n - 2 and gaps["large_from_ms"] == pytest.approx(30.0)
    assert gaps["large_opened_at"] == {"decode_launched": 1, "sent": 1, "client": 1}
    assert gaps["decode_launched"]["p50_ms"] == pytest.approx(5.0)
    assert gaps["client"]["p99_ms"] == pytest.approx(30.0)
    assert token_gaps([record("text", 0.0, 0.1, 0.005)]) is None  # no per-token moments
    assert "client_loop_stalled" not in gaps  # no stalls given (runs before bench.peer.client_loop)

    # the client's gap (before token 30) on the send's clock, and the load generator's loop stalls around it
    clocked = {**rec, "timeline": {"events": [], "tokens": tokens}, "sent_clock_s": 1000.0}
    end_s = 1000.0 + rec["token_s"][30]
    for lag_ms, stalled in ((20.0, 1), (10.0, 0)):  # 60% of its 25-ms excess over the p50 gap: 15 ms
        gaps = token_gaps([clocked], [[end_s, lag_ms]])
        assert gaps["client_loop_stalled"] == stalled and gaps["large_opened_at"]["client"] == 1
    assert token_gaps([clocked], [[end_s - 1.0, 20.0]])["client_loop_stalled"] == 0  # a stall a second before
    start_s = 1000.0 + rec["token_s"][29]  # a 20-ms stall ending 0.1 ms into the gap: the loop was free in it
    assert token_gaps([clocked], [[start_s + 1e-4, 20.0]])["client_loop_stalled"] == 0


def test_gap_places_count_the_largest_gaps_by_their_place_in_each_reply():
    """Twenty requests of 20 tokens 5 ms apart, but each one's first gap 30 ms (joining decode) and, in two of them,
    the last gap 40 ms (a stalled end): the p99 of the 380 gaps is a 30-ms one, and all 22 gaps at or above it are
    placed."""
    slow_end = [0.030] + [0.005] * 17 + [0.040]
    plain = [0.030] + [0.005] * 18
    records = [record("text", 0.0, 0.1, slow_end if k < 2 else plain) for k in range(20)]
    places = gap_places(records)
    assert places["gaps"] == 380 and places["p99_ms"] == pytest.approx(30.0)
    assert places["large_at"] == {"first": 20, "second": 0, "last_six": 2, "other": 0}
    assert gap_places([record("text", 0.0, 0.1, [], tokens=1)]) is None  # one token: no gap



def test_gap_phases_place_each_text_gap_in_the_phase_of_the_step_it_ended_in():
    """One image step launched at 1.0 s: 40 ms of encode, then 60 of prefill. A text stream sent at 0.9 s whose
    decode reads come 10-15 ms apart, but 30 ms apart inside the step's prefill phase (1.04 to 1.1 s)."""
    step = {"event": "step", "ms": 200.0, "launched_ms": 100.0, "worker_ms": 100.0, "encode_groups": 1,
            "encode_patches": 4784, "prefill_tokens": 1278, "encode_ms": 40.0, "prefill_ms": 58.0}
    image = {**record("image", 0.9, 0.3, 0.01), "timeline": {"events": [step]}}
    reads_ms = [50.0, 60.0, 70.0, 80.0, 90.0, 105.0, 115.0, 125.0, 135.0, 165.0, 195.0, 210.0, 220.0]
    text = {**record("text", 0.9, 0.05, 0.01, tokens=len(reads_ms)),
            "timeline": {"events": [], "tokens": {"decode_read_us": [round(ms * 1e3) for ms in reads_ms]}}}
    phases = gap_phases([image, text])
    assert phases["p99_ms"] == pytest.approx(30.0)
    assert phases["encode"]["gaps"] == 4 and phases["encode"]["max_ms"] == pytest.approx(15.0)  # reads at 105-135
    assert phases["prefill"] == {"gaps": 2, "p50_ms": pytest.approx(30.0), "p99_ms": pytest.approx(30.0),
                                 "max_ms": pytest.approx(30.0), "at_p99": 2}  # reads at 165 and 195
    assert phases["no_step"]["gaps"] == 6 and phases["no_step"]["at_p99"] == 0
    assert gap_phases([image]) is None  # no text stream
