"""How a request's tokens become its replies (orchestrator.frontend._send_tokens): streamed, one reply per item, the
last with the finish reason; with ``return_timeline`` on a token channel the last tokens go in a reply of their own
and the timeline in a trailing one after it, so that their send is on the timeline and does not wait for its JSON;
on a request's own stream the timeline stays on the last tokens' final reply."""
import asyncio
import json
from types import SimpleNamespace

import pytest

from orchestrator.frontend import _send_tokens
from orchestrator.output_processor import Piece
from orchestrator.replies import Reply
from orchestrator.send_lanes import merged
from orchestrator.timeline import Timeline
from tests.unit.orchestrator import fake_responses
from tests.unit.orchestrator.fake_responses import FINAL
from tests.unit.orchestrator.test_replies import parsed


@pytest.fixture(autouse=True)
def pb(monkeypatch):
    fake_responses.install(monkeypatch)


def replies_of(request, timeline: Timeline, trail_timeline: bool = False) -> list[Reply]:
    """The replies ``_send_tokens`` hands over for three items, the last ending the request."""
    items = [Piece("He", [1], None), Piece("llo", [2], None), Piece("!", [3], "length")]

    async def tokens():
        for item in items:
            yield item

    admitted = SimpleNamespace(parsed=request, visual_cap=None, media=None, prompt=SimpleNamespace(input_ids=[0] * 7),
                               counts=SimpleNamespace(cached_tokens=0), prompt_text=None)
    timer = SimpleNamespace(output=lambda n: None, finished=lambda reason: None)
    out: list[Reply] = []
    asyncio.run(_send_tokens(admitted, tokens(), out.append, timer, timeline, trail_timeline))
    return out


def test_without_a_timeline_the_last_tokens_reply_ends_the_request():
    out = replies_of(parsed(), Timeline(0.0))
    assert [(r.text, r.ids, r.reason, r.flags) for r in out] == [
        ("He", [1], None, 0), ("llo", [2], None, 0), ("!", [3], "length", FINAL)]
    assert not any(r.trailing for r in out)


def test_on_its_own_stream_a_requests_timeline_stays_on_its_last_tokens_final_reply():
    out = replies_of(parsed(timeline=True), Timeline(0.0))
    assert [(r.text, r.reason, r.flags, r.trailing) for r in out][-1] == ("!", "length", FINAL, False)
    assert "timeline" in out[-1].build().outputs() and len(out) == 3


def test_on_a_channel_a_streamed_timeline_trails_the_last_tokens_and_records_their_send():
    timeline = Timeline(0.0)
    out = replies_of(parsed(timeline=True), timeline, trail_timeline=True)
    assert [(r.text, r.ids, r.reason, r.flags, r.trailing) for r in out] == [
        ("He", [1], None, 0, False), ("llo", [2], None, 0, False), ("!", [3], None, 0, False),
        ("", [], "length", FINAL, True)]
    built, sender = [], object()
    for _, reply in merged([(sender, r) for r in out]):  # a lane's drain: the tokens as one response, then the end
        built.append(reply.build().outputs())
        reply.sent()
    assert [b["text_output"][0] for b in built] == ["Hello!", ""]
    last = built[-1]
    assert (last["finish_reason"][0], last["num_output_tokens"][0]) == ("length", 3)
    assert len(json.loads(last["timeline"][0])["tokens"]["sent_us"]) == 3  # every token's send, the last one's too
