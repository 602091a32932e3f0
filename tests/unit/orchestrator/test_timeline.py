"""A request's timeline (orchestrator/timeline.py): per-token moments beside its events."""
import json

from orchestrator.timeline import NO_TIMELINE, Timeline


def test_tokens_moments_in_ms_since_arrival_unmeasured_ones_none():
    timeline = Timeline(100.0)
    timeline.decoded(100.010, 100.012, 100.013)
    timeline.decoded(0.0, 0.0, 100.020)  # a step the decode stage did not time
    tokens = json.loads(timeline.to_json())["tokens"]
    assert tokens == {"decode_launched_ms": [10.0, None], "decode_read_ms": [12.0, None],
                      "received_ms": [13.0, 20.0]}


def test_no_tokens_no_key_and_the_empty_timeline_records_nothing():
    assert "tokens" not in json.loads(Timeline(0.0).to_json())
    NO_TIMELINE.decoded(1.0, 2.0, 3.0)
    NO_TIMELINE.sent(2)
    assert all(not at for at in NO_TIMELINE.tokens.values())
