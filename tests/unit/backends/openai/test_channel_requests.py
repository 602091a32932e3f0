"""A streamed request over the API process's token channel (backends/openai/orchestrator_client.py, ``_on_channel``):
its pieces come from the channel and its end or error from its own stream, in either order; a broken channel fails
it only once its own stream has ended without its last pieces; a request given up early is cancelled; one refused
for a channel the orchestrator does not know goes again on a new channel."""
from __future__ import annotations

import asyncio
import functools

import pytest

from backends.openai.convert import OrchestratorRequest
from backends.openai.errors import ApiError
from backends.openai.orchestrator_client import OrchestratorClient
from client.pieces import ResponsePiece

REQUEST = OrchestratorRequest("Hi", None, (), {}, True, False)


class Channel:
    """The channel's side: the test puts pieces (or an ApiError, the channel breaking) into the request's queue."""

    name = "c"

    def __init__(self):
        self.queues: dict[str, asyncio.Queue] = {}

    def register(self, request_id: str) -> asyncio.Queue:
        self.queues[request_id] = asyncio.Queue()
        return self.queues[request_id]

    def unregister(self, request_id: str) -> None:
        self.queues.pop(request_id)

    def put(self, item) -> None:
        (queue,) = self.queues.values()
        queue.put_nowait(item)


class OwnStream:
    """The request's own stream: yields what the test releases (a piece, or an ApiError to raise); notes closing."""

    def __init__(self):
        self.items: asyncio.Queue = asyncio.Queue()
        self.closed = False

    async def __call__(self, request, request_id=None, token_channel=None):
        try:
            while True:
                item = await self.items.get()
                if isinstance(item, ApiError):
                    raise item
                yield item
                if item.final:
                    return
        finally:
            self.closed = True


def piece(text: str, reason: str | None = None) -> ResponsePiece:
    return ResponsePiece(text=text.encode(), finish_reason=reason)


END = ResponsePiece(finish_reason="length", final=True)  # the own stream's last response: the reason alone


async def _setup():
    client, channel, own = OrchestratorClient("127.0.0.1:1", "orchestrator"), Channel(), OwnStream()
    client._own_stream = own
    pieces = client._on_channel(REQUEST, channel)
    return client, channel, own, pieces


async def _collect(pieces) -> list[str]:
    return [p.text.decode() async for p in pieces]


def test_pieces_come_from_the_channel_and_the_request_ends_at_its_reason_whichever_stream_is_first():
    async def run(own_first: bool):
        client, channel, own, pieces = await _setup()
        collecting = asyncio.ensure_future(_collect(pieces))
        await asyncio.sleep(0)
        channel.put(piece("a"))
        if own_first:
            own.items.put_nowait(END)
            await asyncio.sleep(0.01)
            assert not collecting.done()  # its last entries are on the way
        channel.put(piece("b", "length"))
        assert await asyncio.wait_for(collecting, 5) == ["a", "b"]
        own.items.put_nowait(END)
        await asyncio.sleep(0.01)
        assert own.closed and not client._background  # read to its end, never cancelled
    asyncio.run(run(True))
    asyncio.run(run(False))


def test_an_error_on_the_own_stream_fails_the_request():
    async def run():
        _, channel, own, pieces = await _setup()
        own.items.put_nowait(ApiError(400, "messages: bad"))
        with pytest.raises(ApiError, match="messages: bad"):
            await asyncio.wait_for(_collect(pieces), 5)
    asyncio.run(run())


def test_a_broken_channel_waits_for_the_own_streams_word_and_fails_if_the_last_pieces_cannot_come():
    async def run(own_word):
        _, channel, own, pieces = await _setup()
        collecting = asyncio.ensure_future(_collect(pieces))
        await asyncio.sleep(0)
        channel.put(ApiError(503, "the orchestrator closed its token channel"))
        await asyncio.sleep(0.01)
        assert not collecting.done()
        own.items.put_nowait(own_word)
        return await asyncio.wait_for(asyncio.gather(collecting, return_exceptions=True), 5)
    (shutting,) = asyncio.run(run(ApiError(503, "the server is shutting down")))
    assert isinstance(shutting, ApiError) and shutting.message == "the server is shutting down"
    (lost,) = asyncio.run(run(END))
    assert isinstance(lost, ApiError) and "closed its token channel" in lost.message


def test_a_request_given_up_before_its_end_is_cancelled():
    async def run():
        client, channel, own, pieces = await _setup()
        first = asyncio.ensure_future(anext(pieces))
        await asyncio.sleep(0)
        channel.put(piece("a"))
        assert (await asyncio.wait_for(first, 5)).text == b"a"
        await pieces.aclose()
        await asyncio.sleep(0.01)
        assert own.closed and not client._background and not channel.queues
    asyncio.run(run())


def test_a_request_cancelled_on_the_server_as_its_channel_closed_fails_at_once():
    async def run():
        _, channel, own, pieces = await _setup()
        collecting = asyncio.ensure_future(_collect(pieces))
        await asyncio.sleep(0)
        own.items.put_nowait(ResponsePiece(finish_reason="abort", final=True))
        return await asyncio.wait_for(asyncio.gather(collecting, return_exceptions=True), 5)
    (error,) = asyncio.run(run())
    assert isinstance(error, ApiError) and error.status == 503 and "token channel closed" in error.message


def test_a_request_refused_for_a_channel_the_orchestrator_does_not_know_goes_again_on_a_new_one():
    """The orchestrator was loaded again (Triton's model control) and knows no channel of the API's: the request,
    refused before anything was made, is sent again on a newly opened channel, and the old one is closed (its
    stream held the old orchestrator instance, which could not unload). Refused there too, it fails with 503."""
    unknown = ApiError(400, "token_channel: no channel 'c' is open (open one with open_token_channel)")

    async def run(refusals: int):
        client = OrchestratorClient("127.0.0.1:1", "orchestrator")
        channels, closed, sent_on = [Channel(), Channel()], [], []

        async def close(channel: Channel) -> None:
            closed.append(channel)

        for channel in channels:
            channel.broken, channel.close = None, functools.partial(close, channel)
        opened = iter(channels)

        async def open_channel():
            return next(opened)

        async def own(request, request_id=None, token_channel=None):
            sent_on.append(token_channel)
            if len(sent_on) <= refusals:
                raise unknown
            channels[1].put(piece("a", "length"))
            yield END

        client._channel, client._own_stream = open_channel, own
        try:
            return [p.text.decode() async for p in client.generate(REQUEST)], sent_on, closed, channels
        except ApiError as exc:
            return exc, sent_on, closed, channels
        finally:
            await asyncio.sleep(0.01)

    got, sent_on, closed, channels = asyncio.run(run(1))
    assert got == ["a"] and sent_on == ["c", "c"] and closed == [channels[0]] and channels[0].broken.status == 503
    error, sent_on, closed, _ = asyncio.run(run(2))
    assert isinstance(error, ApiError) and error.status == 503 and "token channel closed" in error.message
    assert len(sent_on) == 2 and len(closed) == 2
