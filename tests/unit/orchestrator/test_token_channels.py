"""Token channels (orchestrator/token_channels.py): a lane sends one response for everything queued on a channel,
each entry the outputs its reply would have had on its request's own stream; a channel answers at once, closes on
its client's cancellation or the server's stop with a final response, and names are checked."""
import asyncio
import dataclasses
import json
import threading

import pytest

from backends.ipc.link import StageError
from orchestrator.replies import Reply
from orchestrator.sampling_params import InvalidInput
from orchestrator.send_lanes import merged
from orchestrator.service import Overloaded
from orchestrator.timeline import Timeline
from orchestrator.replies import Built
from orchestrator.token_channels import ChannelItem, TokenChannels, channel_name, routed
from tests.unit.orchestrator import fake_responses
from tests.unit.orchestrator.fake_responses import FINAL
from tests.unit.orchestrator.test_replies import parsed, replies


@pytest.fixture(autouse=True)
def pb(monkeypatch):
    fake_responses.install(monkeypatch)


def entries(response) -> list[dict]:
    return json.loads(response.outputs()["channel_items"][0])


def test_a_channels_queued_items_go_as_one_response_each_entry_as_its_own_stream_would_carry_it():
    channel, other = object(), object()
    a, b = replies(parsed(), ["A0", "A1"]), replies(parsed(), ["B0"])
    queued = [(channel, ChannelItem((("a", a[0]),))), (other, a[0]), (channel, ChannelItem((("b", b[0]),))),
              (channel, ChannelItem((("a", a[1]),)))]
    out = merged(queued)
    assert [s for s, _ in out] == [channel, other]
    sent = entries(out[0][1].build())
    assert [e["id"] for e in sent] == ["a", "b", "a"]
    assert sent[0] == {"id": "a", **{k: v[0] if k != "output_ids" else v for k, v in a[0].build().outputs().items()}}
    assert (sent[2]["finish_reason"], sent[2]["num_output_tokens"], sent[2]["num_cached_tokens"]) == ("length", 2, 3)
    assert json.loads(sent[0]["media"]) == json.loads(a[0].build().outputs()["media"][0])


def test_nothing_merges_into_a_channels_final_response_and_its_flag_survives_a_merge():
    last = ChannelItem((), FINAL)
    assert last.merge(ChannelItem(())) is None
    merged_item = ChannelItem((("a", replies(parsed(), ["x"])[0]),)).merge(last)
    assert merged_item.flags == FINAL and len(merged_item.entries) == 1


def test_timelines_and_the_final_flag_go_after_the_tokens_queued_with_them():
    """A request's timeline comes in a reply of its own after its last tokens (Reply.trailing): on a channel the
    lane sends the other requests' tokens first, then the timelines, the channel's final flag last."""
    channel = object()
    a_last, b_last = (Reply(parsed(timeline=True), t, [1], None, 7, 2) for t in ("a", "b"))
    a_end, b_end = (Reply(parsed(timeline=True), "", [], "length", 7, 2, FINAL, timeline=Timeline(0.0))
                    for _ in range(2))
    assert a_end.trailing and not a_last.trailing and ChannelItem((), FINAL).trailing
    queued = [(channel, ChannelItem((("a", a_last),))), (channel, ChannelItem((("a", a_end),))),
              (channel, ChannelItem((("b", b_last),))), (channel, ChannelItem((("b", b_end),))),
              (channel, ChannelItem((), FINAL))]
    (_, tokens), (_, ends) = merged(queued)
    assert [e["text_output"] for e in entries(tokens.build())] == ["a", "b"] and tokens.flags == 0
    assert [("timeline" in e, e["finish_reason"]) for e in entries(ends.build())] == [(True, "length")] * 2
    assert ends.flags == FINAL


def test_sent_notes_every_entrys_tokens_on_its_timeline():
    timeline = Timeline(0.0)
    first, second = replies(parsed(timeline=True), ["one", " two"], timeline=timeline)
    ChannelItem((("a", first), ("a", second))).sent()
    assert len(json.loads(timeline.to_json())["tokens"]["sent_us"]) == 2


def test_an_entry_that_cannot_be_built_makes_an_internal_error_response():
    bad = Reply(parsed(), "x", [object()], "length", 1, 1, FINAL)
    response = ChannelItem((("a", bad),)).build()
    assert response.error.code == "INTERNAL" and "internal error" in response.error.message


@pytest.mark.parametrize("values, words", [
    ([b"a", b"b"], "expected one channel name, got 2"),
    ([b""], "a channel name is 1 to 256 bytes, got 0"),
    ([b"x" * 257], "a channel name is 1 to 256 bytes, got 257"),
    ([b"\xff"], "not valid UTF-8"),
])
def test_channel_names_are_checked(values, words):
    with pytest.raises(InvalidInput, match=f"token_channel: {words}"):
        channel_name(values, "token_channel")
    assert channel_name([], "token_channel") == "" and channel_name(["é".encode()], "token_channel") == "é"


class Lanes:
    """Records what would be sent: (lane, sender, item)."""

    def __init__(self):
        self.sent = []

    def lane(self) -> int:
        return 3

    def send(self, lane, sender, item) -> None:
        self.sent.append((lane, sender, item))


class Cancels:
    def __init__(self):
        self.watched, self.unwatched = [], []

    def watch(self, is_cancelled, on_cancel):
        self.watched.append(on_cancel)
        return on_cancel

    def unwatch(self, entry) -> None:
        self.unwatched.append(entry)


class Sender:
    def is_cancelled(self) -> bool:
        return False


def test_a_channel_answers_at_once_takes_replies_and_closes_with_its_final_response_on_cancel():
    async def run():
        channels, lanes, cancels, sender = TokenChannels(), Lanes(), Cancels(), Sender()
        serving = asyncio.ensure_future(channels.serve("c", sender, lanes, cancels))
        await asyncio.sleep(0)
        assert [(lane, s, item.entries, item.flags) for lane, s, item in lanes.sent] == [(3, sender, (), 0)]
        with pytest.raises(InvalidInput, match="open_token_channel: a channel 'c' is open already"):
            await channels.serve("c", Sender(), lanes, cancels)
        reply = replies(parsed(), ["x", "y"])[0]
        assert routed(channels.get("c"), "r1", reply, lanes, FINAL) is None
        assert lanes.sent[-1][2].entries == (("r1", reply),)
        cancelled, channel = [], channels.get("c")
        for key in ("r1", "r2", "r3"):
            channels.claim("c", key, stream=True)
        channel.bind("r1", lambda: cancelled.append(1))
        channel.bind("r2", lambda: cancelled.append(2))
        routed(channel, "r2", Built(flags=FINAL), lanes, FINAL)  # ended before the channel closed
        threading.Thread(target=cancels.watched[0]).start()  # the cancel watch's thread sees the cancellation
        await asyncio.wait_for(serving, 5)
        assert lanes.sent[-1][2].flags == FINAL and cancels.unwatched == cancels.watched[:1]
        assert cancelled == [1]  # its running requests are cancelled: nobody reads their replies
        channel.bind("r3", lambda: cancelled.append(3))  # one admitted after the close, as it binds
        assert cancelled == [1, 3]
        with pytest.raises(InvalidInput, match="token_channel: no channel 'c' is open"):
            channels.get("c")
    asyncio.run(run())


def test_the_servers_stop_closes_every_channel_and_any_opened_later():
    async def run():
        channels, lanes = TokenChannels(), Lanes()
        serving = [asyncio.ensure_future(channels.serve(name, Sender(), lanes, Cancels())) for name in "ab"]
        await asyncio.sleep(0)
        channels.close_all()
        await asyncio.wait_for(asyncio.gather(*serving), 5)
        await asyncio.wait_for(channels.serve("late", Sender(), lanes, Cancels()), 5)
        assert [item.flags for _, _, item in lanes.sent].count(FINAL) == 3
    asyncio.run(run())


def test_a_requests_own_stream_gets_its_errors_and_its_end_only():
    """The last reply's own final response holds its finish reason alone; a cancelled request's empty final one
    says "abort"; an error goes as it is; replies for a closed channel are dropped, a request bound then is cancelled
    at once."""
    async def run():
        channels, lanes = TokenChannels(), Lanes()
        serving = asyncio.ensure_future(channels.serve("c", Sender(), lanes, Cancels()))
        await asyncio.sleep(0)
        channel = channels.get("c")
        *_, last = replies(parsed(), ["x", "y"])
        assert routed(channel, "r1", last, lanes, FINAL).build().outputs() == {"finish_reason": ["length"]}
        assert routed(channel, "r1", Built(flags=FINAL), lanes, FINAL).build().outputs() == {"finish_reason": ["abort"]}
        error = Built("an error response", FINAL)
        assert routed(channel, "r1", error, lanes, FINAL) is error
        channels.close_all()
        await serving
        count = len(lanes.sent)
        assert routed(channel, "r1", replies(parsed(), ["x", "y"])[0], lanes, FINAL) is None
        assert len(lanes.sent) == count
        cancelled = []
        channel.bind("r3", lambda: cancelled.append(3))
        assert cancelled == [3]
    asyncio.run(run())


async def _open(channels: TokenChannels, name: str, lanes: Lanes) -> asyncio.Future:
    serving = asyncio.ensure_future(channels.serve(name, Sender(), lanes, Cancels()))
    await asyncio.sleep(0)
    return serving


def test_a_request_id_in_flight_on_a_channel_is_refused_there_only():
    """Two requests with one id on one channel would give entries nobody can tell apart: the second is refused,
    naming the id and the channel; another channel, or a request not streamed (its one response on its own stream),
    takes the id. A missing id, or a name not open, is refused as before."""
    async def run():
        channels, lanes = TokenChannels(), Lanes()
        serving = [await _open(channels, name, lanes) for name in ("c", "d")]
        assert channels.claim("c", "r1", stream=True) is channels.get("c")
        with pytest.raises(InvalidInput, match="token_channel: a request with id 'r1' is in flight on channel 'c' "
                                               "already"):
            channels.claim("c", "r1", stream=True)
        assert channels.claim("d", "r1", stream=True) is channels.get("d")
        assert channels.claim("c", "r1", stream=False) is None
        assert list(channels.get("c").bound) == ["r1"]
        with pytest.raises(InvalidInput, match="token_channel: a request on a channel needs a request id"):
            channels.claim("c", "", stream=True)
        with pytest.raises(InvalidInput, match="token_channel: no channel 'e' is open"):
            channels.claim("e", "r1", stream=False)
        channels.close_all()
        await asyncio.gather(*serving)
    asyncio.run(run())


@pytest.mark.parametrize("last", [
    pytest.param(lambda: replies(parsed(), ["x", "y"])[-1], id="finished"),
    pytest.param(lambda: Built(flags=FINAL), id="cancelled"),
    pytest.param(lambda: Built("an error response", FINAL), id="failed"),
])
def test_a_request_id_is_free_again_once_its_final_response_goes(last):
    """However the request ended, its final item frees its id (nothing stays in ``bound``); the items before it do
    not."""
    async def run():
        channels, lanes = TokenChannels(), Lanes()
        serving = await _open(channels, "c", lanes)
        channel = channels.claim("c", "r1", stream=True)
        channel.bind("r1", lambda: None)
        routed(channel, "r1", replies(parsed(), ["x", "y"])[0], lanes, FINAL)
        with pytest.raises(InvalidInput, match="in flight"):
            channels.claim("c", "r1", stream=True)
        routed(channel, "r1", last(), lanes, FINAL)
        assert channel.bound == {}
        assert channels.claim("c", "r1", stream=True) is channel
        channels.close_all()
        await serving
    asyncio.run(run())


def test_channels_beyond_the_limit_are_refused_as_overloaded_until_one_closes():
    """``max_token_channels``: one more open channel is refused (UNAVAILABLE, naming the parameter); once one has
    closed, another opens."""
    async def run():
        channels, lanes, cancels = TokenChannels(max_open=2), Lanes(), Cancels()
        serving = [asyncio.ensure_future(channels.serve(name, Sender(), lanes, cancels)) for name in "ab"]
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match=r"2 token channels are open.*parameter max_token_channels"):
            await channels.serve("c", Sender(), lanes, cancels)
        threading.Thread(target=cancels.watched[0]).start()  # channel a's client cancels it
        await asyncio.wait_for(serving[0], 5)
        third = asyncio.ensure_future(channels.serve("c", Sender(), lanes, cancels))
        await asyncio.sleep(0)
        assert channels.get("c") and not third.done()
        channels.close_all()
        await asyncio.wait_for(asyncio.gather(serving[1], third), 5)
    asyncio.run(run())
    with pytest.raises(ValueError, match="max_token_channels must be at least 1, got 0"):
        TokenChannels(max_open=0)


def test_a_request_naming_a_channel_once_the_server_stops_is_told_so():
    """The channels closed because the server stops (a stage unloaded alone, say): a request naming one is refused
    as the server's stop (the OpenAI API's 503 "shutting down", saying why), not as an unknown channel, which the
    API took for a channel to open again."""
    async def run():
        channels, lanes = TokenChannels(), Lanes()
        serving = await _open(channels, "c", lanes)
        channels.close_all("its model decode was unloaded")
        await serving
        with pytest.raises(StageError, match=r"^the server is shutting down \(its model decode was unloaded\)"):
            channels.claim("c", "r1", stream=True)
    asyncio.run(run())


def test_prompt_ids_travel_as_one_int64_output_each_entry_holding_its_count():
    """A 3-minute video's 107,002 ids as JSON stalled the other streams merged into its response
    (bench/results/peer/h100-run-2026-12-07/): the entries hold counts, the ids one tensor in entry order."""
    a, b = replies(parsed(input_ids=True), ["A0", "A1"]), replies(parsed(), ["B0"])
    first = dataclasses.replace(a[0], first_outputs=a[0].first_outputs + (("input_ids", [5, 6, 7]),))
    other = dataclasses.replace(b[0], first_outputs=b[0].first_outputs + (("input_ids", [8]),))
    response = ChannelItem((("a", first), ("b", other), ("a", a[1]))).build()
    sent = entries(response)
    assert [(e["id"], e.get("input_ids")) for e in sent] == [("a", 3), ("b", 1), ("a", None)]
    assert list(response.outputs()["input_ids"]) == [5, 6, 7, 8]
    assert "input_ids" not in ChannelItem((("a", a[1]),)).build().outputs()  # none without a prompt's ids
