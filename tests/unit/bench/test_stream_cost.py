"""bench/stream_cost.py's hops from the requests' timelines: decode's read to the orchestrator's receipt, and that
receipt to the send that brought the token (the first token, from prefill, has no receipt: sent_us is one longer)."""
import pytest

from bench.peer.load import RequestRecord
from bench.peer.load import ChatRequest, chat_parts
from bench.stream_cost import hops


def test_hops_pair_each_token_from_decode_with_its_send():
    record = RequestRecord("text", 0.0, [0.1, 0.2, 0.3], timeline={"tokens": {
        "decode_read_us": [10000, None], "received_us": [11000, 21500], "sent_us": [5000, 12000, 25500]}})
    got = hops([record])
    assert got["read_to_received"]["count"] == 1 and got["read_to_received"]["max"] == pytest.approx(1.0)
    assert got["received_to_sent"]["count"] == 2
    assert (got["received_to_sent"]["p50"], got["received_to_sent"]["max"]) == pytest.approx((2.5, 4.0))


def test_no_timelines_no_hops():
    assert hops([RequestRecord("text", 0.0, [0.1, 0.2])]) == {}


def test_a_requests_extra_fields_go_into_its_body():
    """``--top-logprobs``' fields (``ChatRequest.extra``) join the body; a request without them has none."""
    asked = ChatRequest("text", chat_parts("hi"), 4, extra=(("logprobs", True), ("top_logprobs", 5))).body("m")
    assert (asked["logprobs"], asked["top_logprobs"], asked["max_tokens"]) == (True, 5, 4)
    assert "logprobs" not in ChatRequest("text", chat_parts("hi"), 4).body("m")
