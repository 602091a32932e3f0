"""The API process's token channel to the orchestrator (``orchestrator.token_channels``): one Triton stream carrying
the replies of this process's streamed requests, a response per decode step for all of them instead of one per
request and token.

It is opened when the API process starts (``OrchestratorClient.open_channel``; else by the first streamed
request); its first (empty) response says it is open. Each later response's ``channel_items`` entries go to the
queue of the request named by their ``id``, read as the generate endpoint's events are read
(``client.http_stream.piece_from_event``). If it breaks (the orchestrator closed it, tritonserver went away), every
request's queue gets that error (the request's own stream then says how it ends) and the next streamed request
opens another.
"""
from __future__ import annotations

import asyncio
import json
import os
import uuid

import grpc
import numpy as np
import tritonclient.grpc.aio as grpc_aio
from tritonclient.grpc import InferInput
from tritonclient.utils import InferenceServerException

from backends.openai.errors import ApiError, from_orchestrator, from_transport
from client.pieces import LARGE_RESPONSE_BYTES, ResponsePiece, is_final, with_prompt
from client.http_stream import piece_from_event


class ChannelRefused(Exception):
    """The orchestrator opens no token channel for this process: it has none (Triton refused the
    ``open_token_channel`` input), or as many open as its ``max_token_channels``."""


class TokenChannel:
    """An open channel: :meth:`open` it, :meth:`register` each request (by its Triton request id) before sending it
    with ``token_channel`` = :attr:`name`, read its pieces (``client.pieces.ResponsePiece``) from the returned queue,
    :meth:`unregister` it when done. A queue gets an ApiError when the channel breaks (:attr:`broken` says why)."""

    def __init__(self, name: str):
        self.name = name
        self.broken: ApiError | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._closing = asyncio.Event()
        self._responses = None
        self._reader: asyncio.Task | None = None

    @classmethod
    async def open(cls, client: grpc_aio.InferenceServerClient, model: str) -> TokenChannel:
        """A channel opened on ``model`` (the orchestrator) through ``client``. Raises ChannelRefused when the
        orchestrator has no channels, ApiError with its other errors (``errors.from_orchestrator``: e.g. the server
        is stopping) or the transport's (``errors.from_transport``)."""
        channel = cls(f"openai-{os.getpid()}-{uuid.uuid4().hex}")
        name = InferInput("open_token_channel", [1], "BYTES")
        name.set_data_from_numpy(np.array([channel.name.encode()], dtype=np.object_))

        async def requests():
            yield {"model_name": model, "inputs": [name], "request_id": channel.name}
            await channel._closing.wait()  # the stream's sending side stays open while the channel is

        channel._responses = client.stream_infer(requests())
        try:
            _, error = await anext(channel._responses)
        except StopAsyncIteration:
            channel._closing.set()
            raise ApiError(503, "the inference server closed the token channel at once",
                           code="service_unavailable") from None
        except BaseException as exc:  # the transport's error, or this request given up while the channel opens
            channel._responses.cancel()
            channel._closing.set()
            if isinstance(exc, (grpc.RpcError, InferenceServerException)):
                raise from_transport(exc) from None
            raise
        if error is not None:
            channel._closing.set()
            if "open_token_channel" in error.message():  # Triton names an input the model does not have
                raise ChannelRefused(error.message())
            raise from_orchestrator(error.message())
        channel._reader = asyncio.get_running_loop().create_task(channel._read())
        return channel

    def register(self, request_id: str) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        if self.broken is not None:
            queue.put_nowait(self.broken)
        self._queues[request_id] = queue
        return queue

    def unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def close(self) -> None:
        """Cancel the channel's request (the orchestrator then closes it) and wait for the reader."""
        self._closing.set()
        if self._responses is not None:
            self._responses.cancel()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    async def _read(self) -> None:
        ended = False  # the orchestrator sent the channel's final response (a finished call is not cancelled)
        try:
            async for result, error in self._responses:
                if error is not None:
                    raise from_orchestrator(error.message())
                items, prompts = result.as_numpy("channel_items"), result.as_numpy("input_ids")
                raw = b"" if items is None else items.reshape(-1)[0]
                prompts = None if prompts is None else prompts.reshape(-1)
                pieces = await asyncio.to_thread(_pieces, raw, prompts) if len(raw) > LARGE_RESPONSE_BYTES \
                    else _pieces(raw, prompts)
                for request_id, piece in pieces:
                    queue = self._queues.get(request_id)
                    if queue is not None:
                        queue.put_nowait(piece)
                if is_final(result):
                    ended = True  # the orchestrator closed the channel (the server stops)
                    break
            self.broken = ApiError(503, "the orchestrator closed its token channel (is the server stopping?)",
                                   code="service_unavailable")
        except ApiError as exc:
            self.broken = exc
        except (grpc.RpcError, InferenceServerException) as exc:
            self.broken = from_transport(exc)
        except asyncio.CancelledError:
            self.broken = ApiError(503, "the token channel was closed", code="service_unavailable")
            raise
        except Exception as exc:  # a response it cannot read: a bug; its requests must not hang
            self.broken = ApiError(500, f"the token channel failed: {type(exc).__name__}: {exc}")
        finally:
            if not ended:  # else the orchestrator would keep it open, its replies read by nobody
                self._responses.cancel()
            self._closing.set()
            for queue in self._queues.values():
                queue.put_nowait(self.broken)


def _pieces(raw: bytes, prompts: np.ndarray | None = None) -> list[tuple[str | None, ResponsePiece]]:
    """A channel response's ``channel_items`` (JSON text; empty: none) as (request id, piece) in order, an entry's
    ``input_ids`` (a count) taken from ``prompts``, the response's ``input_ids`` (``orchestrator.token_channels``);
    read in a worker thread when over ``LARGE_RESPONSE_BYTES`` (a streamed echo's prompt log probabilities): the
    channel's other requests wait for it either way, the process's others do not. Raises ServerError for an error
    entry, ValueError for text that is not JSON or counts past ``prompts``' end."""
    pieces, taken = [], 0
    for entry in json.loads(raw) if len(raw) else ():
        count = entry.pop("input_ids", None)
        piece = piece_from_event(entry)
        if count is not None:
            if prompts is None or taken + count > len(prompts):
                raise ValueError(f"an entry takes {count} input_ids past the {0 if prompts is None else len(prompts)} "
                                 "the channel response carries")
            piece, taken = with_prompt(piece, prompts[taken:taken + count]), taken + count
        pieces.append((entry.pop("id", None), piece))
    return pieces
