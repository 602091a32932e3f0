import time

from backends.openai.timing import ApiMarks


def test_marks_join_the_orchestrators_timeline_on_its_scale():
    marks = ApiMarks()
    marks.mark("api_sent")
    arrived = time.monotonic()
    timeline = {"arrived_monotonic_s": arrived, "events": [{"ms": 0.5, "event": "parsed"},
                                                           {"ms": 1e4, "event": "final_response"}]}
    time.sleep(0.002)
    marks.mark("api_first_response")
    joined = marks.into(timeline)
    events = [e["event"] for e in joined["events"]]
    assert events == ["api_received", "api_sent", "parsed", "api_first_response", "final_response"]
    ms = {e["event"]: e["ms"] for e in joined["events"]}
    assert ms["api_received"] <= ms["api_sent"] <= 0 <= ms["api_first_response"]
    assert [e["ms"] for e in joined["events"]] == sorted(e["ms"] for e in joined["events"])
    assert joined["arrived_monotonic_s"] == arrived and timeline["events"][0]["event"] == "parsed"  # not changed


def test_a_timeline_without_its_arrival_or_none_is_left_as_it_is():
    marks = ApiMarks()
    assert marks.into(None) is None
    old = {"events": [{"ms": 1.0, "event": "parsed"}]}
    assert marks.into(old) is old


def test_each_tokens_chunk_joins_the_timelines_tokens():
    marks = ApiMarks(per_token=True)
    marks.chunk(1)
    time.sleep(0.002)
    marks.chunk(2)  # a merged response: two tokens in one chunk
    marks.chunk(0)  # e.g. the usage chunk
    arrived = time.monotonic()
    timeline = {"arrived_monotonic_s": arrived, "events": [], "tokens": {"received_us": [1000, 2000, 3000]}}
    tokens = marks.into(timeline)["tokens"]
    assert tokens["received_us"] == [1000, 2000, 3000]
    first, second, third = tokens["api_chunk_us"]
    assert first < second == third <= 0  # made before the orchestrator's arrival on this made-up scale
    assert "api_chunk_us" not in ApiMarks(per_token=True).into(timeline)["tokens"]  # no chunk, nothing added
    unasked = ApiMarks()  # a request without return_timeline: its chunks are not recorded
    unasked.chunk(3)
    assert "api_chunk_us" not in unasked.into(timeline)["tokens"]
