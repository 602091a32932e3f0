"""The orchestrator as the API process reaches it: Triton's gRPC streaming API through ``tritonclient.grpc.aio``,
one bidirectional stream per request on one shared channel.

The orchestrator is decoupled: its responses stream back until the one that carries ``finish_reason`` (every
request ends with one, or with an error, which it sends with the final flag). A request given up before that (its
HTTP client went away) is cancelled by cancelling its gRPC call, which Triton passes to the orchestrator as a
cancellation; a finished one is not (Triton 2.51 can wait forever on the cancellation of a request it has just
finished: client/api.py says more).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Iterator

import grpc
import tritonclient.grpc.aio as grpc_aio
from tritonclient.utils import InferenceServerException

from backends.openai.convert import OrchestratorRequest
from backends.openai.bulk import in_bulk_thread
from backends.openai.errors import ApiError, from_orchestrator, from_transport, unexpected
from backends.openai.token_channel import ChannelRefused, TokenChannel
from client.pieces import LARGE_RESPONSE_BYTES, ResponsePiece, piece_from_grpc, response_bytes

log = logging.getLogger(__name__)
# gRPC retries a lost connection after an exponential backoff up to 120 s by default; a restarted tritonserver was
# answered 503 ("not reachable") for about 10 s after it was ready (a fresh user's test, 2026-12-07). At most 1 s
# here, beside tritonclient's own default options (which channel_args replaces).
_KEEPALIVE = grpc_aio.KeepAliveOptions()
_CHANNEL_ARGS = [
    ("grpc.max_send_message_length", grpc_aio.MAX_GRPC_MESSAGE_SIZE),
    ("grpc.max_receive_message_length", grpc_aio.MAX_GRPC_MESSAGE_SIZE),
    ("grpc.keepalive_time_ms", _KEEPALIVE.keepalive_time_ms),
    ("grpc.keepalive_timeout_ms", _KEEPALIVE.keepalive_timeout_ms),
    ("grpc.keepalive_permit_without_calls", _KEEPALIVE.keepalive_permit_without_calls),
    ("grpc.http2.max_pings_without_data", _KEEPALIVE.http2_max_pings_without_data),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class OrchestratorClient:
    """Requests to ``model`` (the orchestrator) on the tritonserver at ``grpc_url`` (host:port), at most
    ``max_requests`` at once (0: no limit); ``in_flight`` counts those whose responses are still awaited;
    ``token_channel``: streamed requests' replies over the process's token channel (off: on their own streams)."""

    def __init__(self, grpc_url: str, model: str, max_requests: int = 0, token_channel: bool = True):
        self.model, self.max_requests = model, max_requests
        self.in_flight = 0
        self._client = grpc_aio.InferenceServerClient(grpc_url, channel_args=_CHANNEL_ARGS)
        self._token_channel: TokenChannel | None = None
        self._opening = asyncio.Lock()
        self._refused = not token_channel  # asked not to, or the orchestrator opens none
        self._background: set[asyncio.Task] = set()  # channel requests' own streams, awaiting their final responses

    async def ready(self) -> bool:
        """Whether the server and the orchestrator model are ready (False when the server cannot be reached)."""
        try:
            return await self._client.is_server_ready() and await self._client.is_model_ready(self.model)
        except InferenceServerException:
            return False

    async def parameters(self) -> dict[str, str]:
        """The orchestrator's config.pbtxt parameters. Raises ApiError 503 when the server cannot be reached."""
        try:
            config = await self._client.get_model_config(self.model, as_json=True)
        except InferenceServerException as exc:
            raise from_transport(exc) from None
        return {k: v.get("string_value", "") for k, v in config["config"].get("parameters", {}).items()}

    @contextlib.contextmanager
    def reserved(self, requests: int) -> Iterator[None]:
        """Count ``requests`` in flight while the block runs, for ``generate`` calls made with ``reserved=True``
        (one request's several choices: all of them or none). Raises ApiError 503 as ``generate`` does."""
        if self.max_requests and self.in_flight + requests > self.max_requests:
            more = "" if requests == 1 else f" and {requests} more asked"
            raise ApiError(503, f"the server is overloaded: {self.in_flight} requests in flight{more}, its limit (try "
                                "again later)", code="overloaded")
        self.in_flight += requests
        try:
            yield
        finally:
            self.in_flight -= requests

    async def generate(self, request: OrchestratorRequest, reserved: bool = False) -> AsyncIterator[ResponsePiece]:
        """The request's responses, the last one with ``finish_reason``. Close the iterator (``aclosing``) to give
        the request up: it is then cancelled on the server unless it has ended. A streamed request's replies come
        over the process's token channel (``backends.openai.token_channel``) when the orchestrator has one; one that
        the orchestrator refuses for not knowing that channel (it closed it, or was loaded again: a fresh user's
        test left streamed chats failing until the API restarted) is sent once more on a new channel.
        ``reserved``: counted in flight already (:meth:`reserved`).

        Raises ApiError: 503 when ``max_requests`` are in flight; the orchestrator's error
        (``errors.from_orchestrator``), or the transport's (``from_transport``: 503 when tritonserver cannot be
        reached or went away).
        """
        with contextlib.nullcontext() if reserved else self.reserved(1):
            for again in (True, False):
                channel = await self._channel() if request.stream else None
                pieces = self._own_stream(request) if channel is None else self._on_channel(request, channel)
                try:
                    async with contextlib.aclosing(pieces):
                        async for piece in pieces:
                            yield piece
                    return
                except ChannelUnknown as exc:  # refused before anything was made: once more, on a new channel
                    self._forget(channel)
                    if not again:
                        raise exc.error from None

    async def tokenize(self, request: OrchestratorRequest) -> ResponsePiece:
        """The one response of ``request`` sent with ``tokenize_only`` (its ``input_ids``, ``input_tokens``,
        ``prompt_text``). Raises ApiError as :meth:`generate` does."""
        tokenize = dataclasses.replace(request, stream=False, tokenize_only=True)
        with self.reserved(1):
            async with contextlib.aclosing(self._own_stream(tokenize)) as pieces:
                async for piece in pieces:
                    return piece
        raise ApiError(500, "the inference server sent no response to a tokenize request")

    async def _own_stream(self, request: OrchestratorRequest, request_id: str | None = None,
                          token_channel: str | None = None) -> AsyncIterator[ResponsePiece]:
        """The responses of the request's own stream (with ``token_channel``: its errors and its final response
        only); the call is cancelled if the iterator is closed before the last."""
        ended = asyncio.Event()
        inputs = request.inputs(token_channel)  # here: an error building them is raised, not a cancelled call

        async def requests():
            yield {"model_name": self.model, "inputs": inputs,
                   "request_id": request_id or request.request_id or uuid.uuid4().hex}
            await ended.wait()  # the stream's sending side stays open until the request is over

        responses = self._client.stream_infer(requests())
        finished = False
        try:
            async for result, error in responses:
                if error is not None:
                    finished = True
                    raise from_orchestrator(error.message(), request.media, chat=request.messages is not None,
                                            structured_as=request.structured_as)
                piece = (await in_bulk_thread(piece_from_grpc, result)
                         if response_bytes(result) > LARGE_RESPONSE_BYTES else piece_from_grpc(result))
                finished = piece.finish_reason is not None or piece.final
                yield piece
                if finished:
                    return
            raise ApiError(500, "the inference server closed the stream before the request ended")
        except grpc.RpcError as exc:
            finished = True  # the call is over: nothing to cancel
            raise from_transport(exc) from None
        finally:
            if not finished:
                responses.cancel()
            ended.set()

    async def _on_channel(self, request: OrchestratorRequest, channel: TokenChannel) -> AsyncIterator[ResponsePiece]:
        """A streamed request's pieces from ``channel``, its own stream watched for errors and its end; the request
        is cancelled if the iterator is closed before its last piece (not after: its own final response is then
        awaited in the background, and a finished request is never cancelled: the module docstring)."""
        request_id = request.request_id or uuid.uuid4().hex
        queue = channel.register(request_id)

        async def own_end() -> None:  # the own stream's outcome, into the queue
            try:
                async for piece in self._own_stream(request, request_id, channel.name):
                    if piece.final or piece.finish_reason is not None:
                        queue.put_nowait(_OwnEnd(piece.finish_reason))
            except ApiError as exc:
                if exc.message.startswith("token_channel: no channel"):  # closed, or an orchestrator loaded again
                    exc = ChannelUnknown(ApiError(503, "the API's token channel closed (the server is stopping?): "
                                                       "try again", code="service_unavailable"))
                queue.put_nowait(_OwnEnd(None, exc))
            except (Exception, asyncio.CancelledError) as exc:  # anything else ends the request too, never silently
                if isinstance(exc, asyncio.CancelledError) and asyncio.current_task().cancelling():
                    raise  # given up by the reader
                queue.put_nowait(_OwnEnd(None, unexpected(exc)))

        watcher = asyncio.get_running_loop().create_task(own_end())
        self._background.add(watcher)
        watcher.add_done_callback(self._background.discard)
        own, lost, done = None, None, False
        try:
            while not done:
                item = await queue.get()
                if isinstance(item, _OwnEnd):
                    own = item
                    if item.error is not None:
                        raise item.error
                    if item.reason == "abort":  # cancelled on the server, as its channel closed: nothing follows
                        done = True
                        raise lost or ApiError(503, "the request was cancelled: the API's token channel closed",
                                               code="service_unavailable")
                    done = item.reason is None  # else its last entries are on the way
                elif isinstance(item, ApiError):  # the channel broke: the own stream says how the request ends
                    lost = item
                else:
                    done = item.finish_reason is not None
                    yield item
                if lost is not None and own is not None and not done:
                    raise lost  # the request has ended, and its last entries cannot come
        finally:
            channel.unregister(request_id)
            if not done and own is None:
                watcher.cancel()  # its stream's iterator is closed mid-way: the request is cancelled

    def _forget(self, channel: TokenChannel) -> None:
        """``channel`` is not the orchestrator's (it closed it, or it was loaded again by Triton's model control and
        the channel's stream holds its old instance, which cannot unload while it is open): the next streamed
        request opens another, and this one is closed in the background."""
        if channel.broken is None:
            channel.broken = ApiError(503, "the orchestrator does not know the API's token channel",
                                      code="service_unavailable")
        closing = asyncio.get_running_loop().create_task(channel.close())
        self._background.add(closing)
        closing.add_done_callback(self._background.discard)

    async def open_channel(self) -> None:
        """Open the token channel ahead of the first streamed request (the API's start); if the server cannot be
        reached yet, the first streamed request opens it."""
        try:
            await self._channel()
        except ApiError as exc:
            log.info("token channel not opened at start (%s): the first streamed request opens it", exc.message)

    async def _channel(self) -> TokenChannel | None:
        """The process's open token channel, opened now if there is none or the last one broke; None when the
        orchestrator refuses channels (then requests keep their own streams)."""
        async with self._opening:
            if self._refused:
                return None
            if self._token_channel is None or self._token_channel.broken is not None:
                try:
                    self._token_channel = await TokenChannel.open(self._client, self.model)
                except ChannelRefused as exc:
                    self._refused = True
                    log.warning("the orchestrator opens no token channel (%s): each request streams on its own", exc)
                    return None
            return self._token_channel

    async def close(self) -> None:
        if self._token_channel is not None:
            await self._token_channel.close()
        await self._client.close()


class ChannelUnknown(Exception):
    """A channel request refused because the orchestrator has no channel of that name: nothing was made for it;
    ``error`` is its answer where a new channel does not serve it either (:meth:`OrchestratorClient.generate`)."""

    def __init__(self, error: ApiError):
        super().__init__(error.message)
        self.error = error


@dataclass(frozen=True)
class _OwnEnd:
    """A channel request's own stream ended: ``error`` the orchestrator's or the transport's, else ``reason`` its
    finish reason (None: cancelled on the server)."""

    reason: str | None
    error: ApiError | ChannelUnknown | None = None
