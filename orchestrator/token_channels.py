"""Token channels: one Triton stream carrying the streamed replies of many requests, so that a decode step costs
one response per channel instead of one per request.

Every Triton response costs the orchestrator a build (its output tensors, under the GIL) and a round trip to the
Triton process (``orchestrator.send_lanes``): 32 streams of 5-ms decode steps are 6,400 responses a second. On the
H200 (2026-12-03, 7B, 32 text streams; ``bench/results/peer/``, ``timelines.json``'s ``token_gaps``) the streams'
TBT p99 grew from 10.7 ms where the orchestrator received the tokens to 16.4 ms where their responses were sent,
and on the CPU machine building the responses held the orchestrator's GIL more than anything else. vLLM's engine
core likewise hands its API server one message a step for all its requests. The OpenAI API's processes
(``backends.openai.token_channel``) open one channel each; any gRPC client may.

The protocol (inputs and outputs of the orchestrator's ``config.pbtxt``):

* A request holding ``open_token_channel`` (a name of the client's choosing, not that of a channel already open)
  and no other input opens a channel. Its first response has an empty ``channel_items`` (``[]``): the channel is
  open from then on. It stays open until the client cancels that request or the server stops; a last response,
  its ``channel_items`` empty, then brings the final flag.
* A streamed request (``stream`` true) whose ``token_channel`` names an open channel, with a request id that no
  other request in flight on that channel has, has its replies sent on that channel: each channel response's
  ``channel_items`` is a JSON list of entries, each one reply of a request in the order of that request's replies:
  the request's id under ``"id"`` and the outputs the reply would have carried on the request's own stream, named as
  the generate endpoint names them (``text_output``, ``output_ids``, ``finish_reason``, ``num_input_tokens``, ...;
  ``visual_cap``, ``media`` and ``timeline`` as JSON text). The request's own stream gets its errors, and at its end
  one response with only ``finish_reason`` and the final flag (``abort`` for a cancelled request). Its channel
  entries and that final response may arrive in either order (a request asking for its timeline gets it in an entry
  of its own, with the finish reason, after its last tokens' entry). A name that is not an open channel is
  INVALID_ARG, and so is a streamed request without an id or with the id of one in flight on the channel (their
  entries could not be told apart); an id is free again once its request's final response is sent, however it ended
  (a cancelled or failed request's entries already queued may still follow on the channel).
  A reply's ``input_ids`` (``return_input_ids``' first reply) are not in its entry's JSON: the entry holds their
  count, and the ids are the next that many of the channel response's ``input_ids`` output (INT64), in entry order.
  JSON took 6-9 ms to write and 10-15 to read on the CPU machine for a 3-minute video's 107,002 ids, and the other
  requests' entries merged into that response waited for both: the streams on the video's OpenAI API process
  stalled 53-67 ms at its first token (an H100 host, bench/results/peer/h100-run-2026-12-07/); as one tensor, about
  2 ms to write.
  A request not streamed keeps its one response on its own stream.
* When a channel closes, the requests bound to it are cancelled (no client reads their replies any more): their own
  streams end with ``abort``, their pages are freed.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
from dataclasses import dataclass, field
from typing import Callable

from backends.triton import triton_io as io
from orchestrator.engine_io import shutting_down
from orchestrator.inputs import one_name
from orchestrator.replies import Built, Reply
from orchestrator.sampling_params import InvalidInput
from orchestrator.service import Overloaded

log = logging.getLogger(__name__)

MAX_OPEN = 64  # channels open at once (max_token_channels): a client may not hold the server's streams without end


def channel_name(values: list[bytes], input_name: str) -> str:
    """The channel name an ``open_token_channel`` / ``token_channel`` input holds ("" when absent). Raises
    InvalidInput as ``inputs.one_name`` does."""
    return one_name(values, input_name, "channel name")


@dataclass(eq=False)
class Channel:
    """An open channel: its request's response ``sender`` and send ``lane``; ``closed`` once the client cancelled
    it or the server stops; ``bound``: the requests in flight on it by request id (:meth:`TokenChannels.claim`),
    each with its cancellation once admitted (None before), called when the channel closes."""

    name: str
    sender: object
    lane: int
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    bound: dict[str, Callable[[], None] | None] = field(default_factory=dict)

    def bind(self, request_id: str, cancel: Callable[[], None]) -> None:
        """Call ``cancel()`` (on the event loop) when the channel closes, or now if it has; ``request_id``: the
        admitted request's, claimed on this channel."""
        if self.closed.is_set():
            cancel()
        else:
            self.bound[request_id] = cancel

    def free(self, request_id: str) -> None:
        """``request_id`` is no longer in flight on the channel (its request's final response, or its handler's end
        without one): another request may claim it."""
        self.bound.pop(request_id, None)


@dataclass(frozen=True)
class ChannelItem:
    """Replies for one channel, ``entries`` of (request id, reply) in order: a send lane's item
    (``orchestrator.send_lanes.Item``) that takes in the channel's later items, so a lane sends one response for
    everything queued on the channel."""

    entries: tuple[tuple[str, Reply], ...]
    flags: int = 0

    @property
    def trailing(self) -> bool:
        """Sent after the lane's other items (``send_lanes.merged``): a timeline's reply (``Reply.trailing``), or
        the channel's final flag, which stays after them."""
        return bool(self.flags) or any(reply.trailing for _, reply in self.entries)

    def merge(self, later) -> ChannelItem | None:
        if not isinstance(later, ChannelItem) or self.flags:
            return None
        return ChannelItem(self.entries + later.entries, later.flags)

    def build(self):
        """The response with ``channel_items``; a non-final INTERNAL error response if building it failed."""
        try:
            entries, prompts = [], []
            for request_id, reply in self.entries:
                fields = reply.fields()
                if "input_ids" in fields:  # their count here, the ids in the response's input_ids (the docstring)
                    prompts.append(fields["input_ids"])
                    fields["input_ids"] = len(prompts[-1])
                entries.append({"id": request_id, **fields})
            outputs = [io.str_tensor("channel_items", [json.dumps(entries)])]
            if prompts:
                outputs.append(io.number_tensor("input_ids", list(itertools.chain.from_iterable(prompts))))
            return io.pb().InferenceResponse(outputs)
        except Exception as exc:
            log.exception("orchestrator: a channel response could not be built")
            return io.error(f"internal error: {type(exc).__name__}: {exc}", invalid_argument=False)

    def sent(self) -> None:
        for _, reply in self.entries:
            reply.sent()


class TokenChannels:
    """The open channels by name, on the orchestrator's event loop: at most ``max_open`` at once (the parameter
    ``max_token_channels``; each OpenAI API process holds one). Raises ValueError for ``max_open`` under 1."""

    def __init__(self, max_open: int = MAX_OPEN):
        if max_open < 1:
            raise ValueError(f"parameter max_token_channels must be at least 1, got {max_open}")
        self.max_open = max_open
        self._open: dict[str, Channel] = {}
        self._stopping: str | None = None  # the server stops (why, if said): close_all ran

    def get(self, name: str) -> Channel:
        """The open channel ``name``; raises InvalidInput when none is open by that name, StageError (the server is
        shutting down) when the server stops: the channels closed for that, and none is opened again."""
        channel = self._open.get(name)
        if channel is None and self._stopping is not None:
            raise shutting_down(self._stopping)
        if channel is None:
            raise InvalidInput(f"token_channel: no channel {name!r} is open (open one with open_token_channel)")
        return channel

    def claim(self, name: str, request_id: str, stream: bool) -> Channel | None:
        """The open channel ``name`` that a request naming it in ``token_channel`` has its replies sent on, its
        ``request_id`` (Triton's) in flight there until its final response (:func:`routed`); None for a request not
        streamed, whose one response goes on its own stream. Raises InvalidInput when no channel ``name`` is open
        (streamed or not), or for a streamed request without an id or whose id is in flight on the channel; StageError
        as :meth:`get`."""
        channel = self.get(name)
        if not stream:
            return None
        if not request_id:
            raise InvalidInput("token_channel: a request on a channel needs a request id (its entries' \"id\")")
        if request_id in channel.bound:
            raise InvalidInput(f"token_channel: a request with id {request_id!r} is in flight on channel {name!r} "
                               f"already (their entries could not be told apart): give each request its own id")
        channel.bound[request_id] = None
        return channel

    async def serve(self, name: str, sender, lanes, cancels) -> None:
        """Open channel ``name`` on ``sender`` (its request's), send the empty first response, and hold it open
        until its client cancels it (asked by ``cancels``, a ``CancelWatch``) or :meth:`close_all`; its final flag
        then follows on the same ``lanes`` lane. Raises InvalidInput when a channel of that name is open, Overloaded
        when ``max_open`` are."""
        if name in self._open:
            raise InvalidInput(f"open_token_channel: a channel {name!r} is open already (choose another name)")
        if len(self._open) >= self.max_open:
            raise Overloaded(f"open_token_channel: {len(self._open)} token channels are open, the server's limit "
                             "(parameter max_token_channels): send requests on their own streams, or retry later")
        channel = self._open[name] = Channel(name, sender, lanes.lane())
        if self._stopping is not None:
            channel.closed.set()
        loop = asyncio.get_running_loop()
        watched = cancels.watch(sender.is_cancelled, lambda: loop.call_soon_threadsafe(channel.closed.set))
        try:
            lanes.send(channel.lane, sender, ChannelItem(()))
            await channel.closed.wait()
        finally:
            cancels.unwatch(watched)
            del self._open[name]
            for cancel in list(channel.bound.values()):  # no client reads their replies any more
                if cancel is not None:  # one not admitted yet is cancelled as it binds
                    cancel()
            # not an empty final response: tritonclient's asyncio client would not hand it over
            lanes.send(channel.lane, sender, ChannelItem((), io.pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL))

    def close_all(self, why: str = "") -> None:
        """The server stops (``why``, if said): every channel, and any opened later, gets its final flag."""
        self._stopping = why
        for channel in self._open.values():
            channel.closed.set()


def routed(channel: Channel, request_id: str, item: Reply | Built, lanes, final: int) -> Reply | Built | None:
    """A channel-bound request's ``item``: a reply is queued on ``channel``'s lane (dropped if the channel has
    closed); returns what goes on the request's own stream instead: nothing for a reply, its finish reason alone for
    the last one (``final`` its flag), ``"abort"`` for the empty final response of a cancelled request, an error as
    it is. The final one, whichever, frees ``request_id`` on the channel (:meth:`TokenChannels.claim`): its client
    may reuse it once it has seen the end, while the request's pages are still being released."""
    if item.flags == final:
        channel.free(request_id)
    if isinstance(item, Reply):
        if not channel.closed.is_set():
            lanes.send(channel.lane, channel.sender, ChannelItem(((request_id, item),)))
        return _finished(item.reason, final) if item.flags == final else None
    if item.flags == final and item.response is None:
        return _finished("abort", final)
    return item


def _finished(reason: str | None, final: int) -> Built:
    return Built(io.pb().InferenceResponse([io.str_tensor("finish_reason", [str(reason)])]), final)
