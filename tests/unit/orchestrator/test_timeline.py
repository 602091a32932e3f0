"""A request's timeline (orchestrator/timeline.py): per-token moments beside its events."""
import json

from orchestrator.timeline import NO_TIMELINE, Timeline


def test_tokens_moments_in_us_since_arrival_unmeasured_ones_none():
    timeline = Timeline(100.0)
    timeline.decoded(100.010, 100.012, 100.013)
    timeline.decoded(0.0, 0.0, 100.020)  # a step the decode stage did not time
    tokens = json.loads(timeline.to_json())["tokens"]
    assert tokens == {"decode_launched_us": [10000, None], "decode_read_us": [12000, None],
                      "received_us": [13000, 20000]}


def test_no_tokens_no_key_and_the_empty_timeline_records_nothing():
    assert "tokens" not in json.loads(Timeline(0.0).to_json())
    NO_TIMELINE.decoded(1.0, 2.0, 3.0)
    NO_TIMELINE.sent(2)
    assert all(not at for at in NO_TIMELINE.tokens.values())
