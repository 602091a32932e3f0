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
import uuid
from typing import AsyncIterator

import grpc
import tritonclient.grpc.aio as grpc_aio
from tritonclient.utils import InferenceServerException

from backends.openai.convert import OrchestratorRequest
from backends.openai.errors import ApiError, from_orchestrator, from_transport
from client.api import ResponsePiece, piece_from_grpc


class OrchestratorClient:
    """Requests to ``model`` (the orchestrator) on the tritonserver at ``grpc_url`` (host:port), at most
    ``max_requests`` at once (0: no limit); ``in_flight`` counts those whose responses are still awaited."""

    def __init__(self, grpc_url: str, model: str, max_requests: int = 0):
        self.model, self.max_requests = model, max_requests
        self.in_flight = 0
        self._client = grpc_aio.InferenceServerClient(grpc_url)

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

    async def generate(self, request: OrchestratorRequest) -> AsyncIterator[ResponsePiece]:
        """The request's responses, the last one with ``finish_reason``. Close the iterator (``aclosing``) to give
        the request up: it is then cancelled on the server unless it has ended.

        Raises ApiError: 503 when ``max_requests`` are in flight; the orchestrator's error (``errors.from_orchestrator``),
        or the transport's (``from_transport``: 503 when tritonserver cannot be reached or went away).
        """
        if self.max_requests and self.in_flight >= self.max_requests:
            raise ApiError(503, f"the server is overloaded: {self.in_flight} requests in flight, its limit (try again "
                                "later)", code="overloaded")
        self.in_flight += 1
        ended = asyncio.Event()

        async def requests():
            yield {"model_name": self.model, "inputs": request.inputs(), "request_id": uuid.uuid4().hex}
            await ended.wait()  # the stream's sending side stays open until the request is over

        responses = self._client.stream_infer(requests())
        finished = False
        try:
            async for result, error in responses:
                if error is not None:
                    finished = True
                    raise from_orchestrator(error.message())
                piece = piece_from_grpc(result)
                finished = piece.finish_reason is not None or piece.final
                yield piece
                if finished:
                    return
            raise ApiError(500, "the inference server closed the stream before the request ended")
        except grpc.RpcError as exc:
            finished = True  # the call is over: nothing to cancel
            raise from_transport(exc) from None
        finally:
            self.in_flight -= 1
            if not finished:
                responses.cancel()
            ended.set()

    async def close(self) -> None:
        await self._client.close()
