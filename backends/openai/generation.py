"""What the generation routes share (``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``): the
model's name checked, a body's fields checked, its http(s) media fetched, its requests sent to the orchestrator
(``choices``) and their responses answered in a shape's bodies (``responses``' chat and completion shapes,
``responses_api.shape``), whole or as server-sent events (``sse-starlette``).

A streamed request is answered with each orchestrator response's chunk (or, from a Responses API shape, events, each
named by its type), then, with ``stream_options.include_usage``, a chunk with the usage alone, then the shape's end
(``data: [DONE]`` after chat and completion chunks; none after Responses API events). Its HTTP status is decided by
its first response: an error that comes before any token (bad input, a server stopping) is answered as a plain error
with its status; one that comes later is sent as the shape's error event (``shape.error``: the chat's and the
completion's ``{"error": ...}``, as vLLM sends it; the Responses API's ``error`` event), and ends the stream. A client
that goes away has its request cancelled on the server.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from sse_starlette import EventSourceResponse

from backends.openai.bulk import in_bulk_thread
from backends.openai.choices import merged
from backends.openai.convert import OrchestratorRequest
from backends.openai.errors import ApiError
from backends.openai.media_fetch import MediaFetcher, needs_fetch
from backends.openai.responses import ChatShape, CompletionShape, Reply
from backends.openai.responses_api.schemas import StreamEvent
from backends.openai.responses_api.shape import ResponsesShape
from backends.openai.response_schemas import ChatCompletionChunk, Completion
from backends.openai.schemas import GenerationRequest
from backends.openai.sliced_json import sliced_json
from backends.openai.timing import ApiMarks
from backends.openai.tokenize_schemas import DetokenizeRequest, TokenizeRequest
from client.pieces import ResponsePiece

if TYPE_CHECKING:
    from backends.openai.app import ApiState

T = TypeVar("T")
Shape = ChatShape | CompletionShape | ResponsesShape
LARGE_BODY_ENTRIES = 2_048  # log-probability entries over which a whole body is made off the event loop


def unknown_model(model: str, served: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist (this server serves `{served}`)", param="model",
                    code="model_not_found")


def refuse(body: GenerationRequest | TokenizeRequest | DetokenizeRequest) -> None:
    """Raises ApiError 400 naming the field ``body.refusal()`` refuses, before anything is built from ``body``."""
    if (refusal := body.refusal()) is not None:
        raise ApiError(400, refusal[1], param=refusal[0])


async def served(request: Request, body: GenerationRequest) -> str:
    """The served model's name, which ``body`` must name when it names one (vLLM takes a request without ``model``, or
    with an empty one, as the served model's). Raises ApiError 404 (another model), 503."""
    card = await request.app.state.api.model_card()
    if body.model and not await request.app.state.api.serves(body.model):
        raise unknown_model(body.model, card.id)
    return card.id


async def generate(request: Request, body: GenerationRequest, prompts: list[OrchestratorRequest],
                   shape: Shape):
    """Fetch http(s) media, send the prompts' requests (once per choice: ``choices``), answer in ``shape``'s bodies
    (``body``'s fields checked: ``refuse``). Raises ApiError (400 bad input, 503, 500)."""
    state: ApiState = request.app.state.api
    marks = ApiMarks(per_token=body.return_timeline)
    if 0 < state.config.max_requests < len(prompts) * shape.n:  # its choices run at once, or not at all (choices)
        what, param = ("choices", "n") if shape.n > 1 else ("prompts", "prompt")
        raise ApiError(400, f"{param}: {len(prompts) * shape.n} {what} at once, more than the "
                            f"{state.config.max_requests} requests this server takes at once (--openai-max-requests)",
                       param=param)
    if any(needs_fetch(prompt) for prompt in prompts):  # a fetch outlives no client
        prompts = await unless_disconnected(request, media_fetched(state.fetcher, prompts))
    marks.mark("api_sent")
    pieces = merged(state.orchestrator, prompts, shape.n)
    if not body.stream:
        async with contextlib.aclosing(pieces):
            replies = await unless_disconnected(request, _gathered(pieces, len(prompts) * shape.n))
        replies[0].timeline = marks.into(replies[0].timeline)
        return await whole_body(shape, replies)
    try:
        first = await unless_disconnected(request, anext(pieces))
    except BaseException:
        await pieces.aclose()
        raise
    marks.mark("api_first_response")
    return EventSourceResponse(_events(first, pieces, shape, body.include_usage, marks), sep="\n",
                               shutdown_grace_period=state.config.shutdown_grace_s)


async def media_fetched(fetcher: MediaFetcher, prompts: list[OrchestratorRequest]) -> list[OrchestratorRequest]:
    """``prompts`` with their http(s) media fetched (``MediaFetcher.resolve``), one after another."""
    return [await fetcher.resolve(prompt) for prompt in prompts]


async def whole_body(shape: Shape, replies: list[Reply]) -> Response:
    """The whole body of ``replies`` in ``shape``, written by pydantic (in Rust; FastAPI's own encoding of a returned
    model walks it in Python: 855 ms against 36 for a 4,096-token prompt echoed with 20 top tokens a token, 10 MB);
    when they hold over ``LARGE_BODY_ENTRIES`` log-probability entries, on the bulk thread (``bulk``) and in slices
    (``sliced_json``), and sent in pieces, so that the event loop serving the process's other requests does not wait
    for it (bench/big_reply_stall.py)."""
    entries = sum(len(reply.logprobs) + len(reply.prompt_logprobs or ()) for reply in replies)
    return await model_body(lambda: shape.whole(replies), large=entries > LARGE_BODY_ENTRIES)


async def model_body(make: Callable[[], BaseModel], large: bool) -> Response:
    """The JSON body of the model ``make()`` returns; a ``large`` one made on the bulk thread (``bulk``) in slices
    (``sliced_json``) and sent in pieces, so that the event loop serving the process's other requests does not
    wait for it."""
    if not large:
        return Response(make().model_dump_json().encode(), media_type="application/json")
    content = await in_bulk_thread(lambda: sliced_json(make()))
    return StreamingResponse(_in_pieces(content), media_type="application/json",
                             headers={"content-length": str(len(content))})


async def _in_pieces(content: bytes, size: int = 1 << 20) -> AsyncIterator[memoryview]:
    """``content`` a MiB at a time: the server writes each to its socket in one call, holding the GIL, so a body of
    tens of MB written whole held the process's event loop for about 175 ms (py-spy, bench/big_reply_stall.py)."""
    view = memoryview(content)
    for start in range(0, len(view), size):
        yield view[start:start + size]


async def _gathered(pieces: AsyncIterator[tuple[int, ResponsePiece]], choices: int) -> list[Reply]:
    replies = [Reply() for _ in range(choices)]
    async for index, piece in pieces:
        replies[index].add(piece)
    return replies


async def _events(first: tuple[int, ResponsePiece], pieces: AsyncIterator[tuple[int, ResponsePiece]], shape: Shape,
                  include_usage: bool, marks: ApiMarks):
    """The stream's events (dicts for sse-starlette): each response's (``_chunk_events``), the usage chunk where
    asked, then ``shape.done`` where the shape has one; an error on the way is sent as ``shape.error``'s event in
    their place. Closing it (the client went away) cancels the request. The piece with the request's timeline
    (choice 0's last) gets ``marks`` joined to it."""
    try:
        marks.mark("api_first_chunk")
        for event in await _chunk_events(shape, first, marks):  # a choice's first chunk: never none
            yield event
        async for item in pieces:
            for event in await _chunk_events(shape, item, marks):
                yield event
        if include_usage and (counts := shape.streamed_usage()) is not None:
            yield {"data": shape.usage_chunk(counts).model_dump_json()}
    except ApiError as exc:
        for event in _sse(shape.error(exc), sliced=False):
            yield event
    finally:
        await pieces.aclose()
    if shape.done is not None:
        yield {"data": shape.done}


async def _chunk_events(shape: Shape, item: tuple[int, ResponsePiece], marks: ApiMarks) -> list[dict]:
    """The events of ``item``'s chunk (``_sse``), made on the bulk thread when it holds over ``LARGE_BODY_ENTRIES``
    log-probability entries (a streamed echo's first chunk carries its prompt's), as ``whole_body`` makes bodies;
    none where ``shape`` sends no chunk for it (a tool call's text not yet a call's)."""
    if shape.chunk_entries(*item) > LARGE_BODY_ENTRIES:
        return await in_bulk_thread(lambda: _sse(_chunk(shape, item, marks), sliced=True))
    return _sse(_chunk(shape, item, marks), sliced=False)


def _sse(chunk: BaseModel | list[StreamEvent] | None, sliced: bool) -> list[dict]:
    """The SSE events of a shape's chunk (or error): none, the chunk, or each event of a list (the Responses API's,
    each named by its ``type`` as OpenAI and vLLM name them), its JSON text (``sliced``: by ``sliced_json``) on one
    line."""
    chunks = [] if chunk is None else chunk if isinstance(chunk, list) else [chunk]
    lines = [one_line(sliced_json(c).decode() if sliced else c.model_dump_json()) for c in chunks]
    return [{"event": c.type, "data": line} if isinstance(c, StreamEvent) else {"data": line}
            for c, line in zip(chunks, lines)]


# Line breaks to str.splitlines() but not to the SSE format (whose lines end at CR, LF or CRLF), which pydantic
# writes as they are: a token's text may hold them.
_SPLITLINES_ONLY = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def one_line(json_text: str) -> str:
    """``json_text`` with U+0085, U+2028 and U+2029 written as JSON escapes (they can only be inside its strings,
    where the escape means the same), so that a client splitting the stream with ``str.splitlines`` (httpx's
    ``aiter_lines``) still reads each event's JSON whole (a fresh user's client, 2026-12-06)."""
    return json_text if json_text.isascii() else json_text.translate(_SPLITLINES_ONLY)


def _chunk(shape: Shape, item: tuple[int, ResponsePiece], marks: ApiMarks
           ) -> ChatCompletionChunk | Completion | list[StreamEvent] | None:
    index, piece = item
    if index == 0:  # the timeline is choice 0's
        marks.chunk(len(piece.token_ids))  # with return_timeline the orchestrator sends them (convert.py)
        if piece.timeline is not None:
            piece = dataclasses.replace(piece, timeline=marks.into(piece.timeline))
    return shape.chunk(index, piece)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result; if the HTTP client goes away first, ``work`` is cancelled and ApiError 499 (nginx's
    "client closed request", which nobody receives) raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ApiError(499, "the client closed the request")
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
