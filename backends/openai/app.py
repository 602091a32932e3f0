"""The OpenAI-compatible HTTP API (FastAPI): ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
``/health``, and vLLM's ``/tokenize``, ``/detokenize``, ``/version``, in front of the orchestrator model of a
tritonserver (``orchestrator_client``).

A streamed request is answered with server-sent events (``sse-starlette``): one chunk per orchestrator response,
then, with ``stream_options.include_usage``, a chunk with the usage alone, then ``data: [DONE]``. Its HTTP status is
decided by its first response: an error that comes before any token (bad input, a server stopping) is answered as
a plain error with its status; one that comes later is sent as an ``{"error": ...}`` event before ``[DONE]``, as
vLLM does. A client that goes away has its request cancelled on the server.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from sse_starlette import EventSourceResponse

from backends.openai import metrics_route
from backends.openai.api_keys import ApiKeys
from backends.openai.body_limit import BodyLimit
from backends.openai.bulk import in_bulk_thread
from backends.openai.config import ApiConfig
from backends.openai.choices import merged
from backends.openai.convert import OrchestratorRequest, chat_request, completion_requests
from backends.openai.errors import ApiError, install_handlers
from backends.openai.media_fetch import MediaFetcher, needs_fetch
from backends.openai.orchestrator_client import OrchestratorClient
from backends.openai.replica_health import ReplicaHealth
from backends.openai.responses import ChatShape, CompletionShape, Reply
from backends.openai.response_schemas import ChatCompletionChunk, Completion, ModelCard, ModelList
from backends.openai.schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest
from backends.openai.sliced_json import sliced_json
from backends.openai.tool_calls import ToolReplies, schema_error
from backends.openai.tokenize_schemas import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest,
                                              TokenizeResponse)
from backends.openai.timing import ApiMarks
from backends.openai.version import VERSION
from client.pieces import ResponsePiece

T = TypeVar("T")


router = APIRouter()
LARGE_BODY_ENTRIES = 2_048  # log-probability entries over which a whole body is made off the event loop


class ApiState:
    """What the routes share: the orchestrator client, the media fetcher, the replicas' health (with a metrics URL)
    and the served model's card."""

    def __init__(self, config: ApiConfig):
        self.config = config
        self.orchestrator = OrchestratorClient(config.grpc_url, config.orchestrator_model, config.max_requests,
                                               config.token_channel)
        self.fetcher = MediaFetcher(config.allow_http_media, config.max_http_media_bytes,
                                    {"image": config.http_image_timeout_s, "video": config.http_video_timeout_s})
        self.replicas = ReplicaHealth(config.metrics_url) if config.metrics_url else None
        self._cards: list[ModelCard] = []
        self._accepted: frozenset[str] = frozenset()

    async def model_cards(self) -> list[ModelCard]:
        """The served model under each of its names, the first the one replies carry (``served_model_names``, else
        the checkpoint folder's name, else the preset), from the orchestrator's parameters (read once). Raises
        ApiError 503 while the server cannot be reached."""
        if not self._cards:
            params = await self.orchestrator.parameters()
            root = params.get("model_path") or params.get("preset", "tiny")
            card = ModelCard(id=Path(root).name, created=int(time.time()), root=root,
                             max_model_len=int(params.get("max_model_len") or 0) or None)
            names = self.config.served_model_names or (card.id,)
            # without names given, the path as loaded too: vLLM's default name is its --model as given
            self._accepted = frozenset(self.config.served_model_names or (card.id, root))
            self._cards = [card.model_copy(update={"id": name}) for name in names]
        return self._cards

    async def model_card(self) -> ModelCard:
        """The served model under the name replies carry (:meth:`model_cards`' first)."""
        return (await self.model_cards())[0]

    async def serves(self, model: str) -> bool:
        """Whether ``model`` names the served model (:meth:`model_cards`)."""
        await self.model_cards()
        return model in self._accepted

    async def healthy(self) -> bool:
        """Whether tritonserver and the orchestrator are ready and, with a metrics URL, the metrics do not say that
        every replica has ended (``replica_health``: metrics that cannot be read leave readiness the answer)."""
        if not await self.orchestrator.ready():
            return False
        return self.replicas is None or await self.replicas.serving() is not False

    async def close(self) -> None:
        await self.fetcher.close()
        if self.replicas is not None:
            await self.replicas.close()
        await self.orchestrator.close()


def create_app(config: ApiConfig) -> FastAPI:
    """The app for ``config`` (run it with uvicorn: ``python -m backends.openai``)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.api = ApiState(config)
        # the token channel now, not in a burst's first request (where its open waits on a busy orchestrator)
        opening = asyncio.get_running_loop().create_task(app.state.api.orchestrator.open_channel())
        yield
        opening.cancel()
        await asyncio.gather(opening, return_exceptions=True)
        await app.state.api.close()

    app = FastAPI(title="UnifiedServe OpenAI-compatible API", lifespan=lifespan)
    install_handlers(app)
    app.include_router(router)
    app.include_router(metrics_route.router)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    if config.api_keys:  # added after the body limit, so it runs before it: a refused request's body is never read
        app.add_middleware(ApiKeys, keys=config.api_keys)
    if config.allowed_origins:  # the outermost: a preflight is answered here, every answer (a 401 too) marked
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    return app


@router.get("/health")
@router.api_route("/ping", methods=["GET", "POST"])  # vLLM's too (SageMaker's health check)
async def health(request: Request) -> Response:
    """200 when tritonserver and the orchestrator are ready and, with ``--metrics-url``, some replica still serves
    (Triton keeps the orchestrator READY once every replica has ended: ``replica_health``), else 503."""
    return Response(status_code=200 if await request.app.state.api.healthy() else 503)


@router.get("/v1/models")
async def models(request: Request) -> ModelList:
    """The served model, a card per served name (vLLM's). 503 while tritonserver cannot be reached."""
    return ModelList(data=await request.app.state.api.model_cards())


@router.get("/v1/models/{model:path}")
async def model(model: str, request: Request) -> ModelCard:
    """The served model's card when ``model`` names it (the SDK's ``models.retrieve``), else 404 model_not_found."""
    api = request.app.state.api
    cards = await api.model_cards()
    if not await api.serves(model):
        raise _unknown_model(model, cards[0].id)
    return next((card for card in cards if card.id == model), cards[0])


def _unknown_model(model: str, served: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist (this server serves `{served}`)", param="model",
                    code="model_not_found")


@router.get("/version")
async def version() -> dict[str, str]:
    """This server's version (vLLM's ``/version``): the ``unifiedserve`` project's, from pyproject.toml."""
    return {"version": VERSION}


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    """vLLM's: the prompt's token ids as the same chat or completion would run it (a chat's template, its media's
    visual tokens after ``mm_processor_kwargs`` and the server's ``max_visual_tokens``), their ``count``, the model's
    ``max_model_len`` (not checked: vLLM's rule), and with ``return_token_strs`` each id's token. Raises ApiError as a
    generation's fields and inputs do (400, 404 another model, 503). A body of over ``LARGE_BODY_ENTRIES`` ids is
    made off the event loop (``_model_body``): a 1-MiB prompt's 786k ids and token strings took about 130 ms to
    write on the CPU machine, a pause of every stream the process serves."""
    card = await request.app.state.api.model_card()
    await _served(request, body)
    _refuse(body)
    prompt = dataclasses.replace(body.orchestrator_request(), input_tokens=body.return_token_strs)
    piece = await _prompt_tokens(request, prompt)
    return await _model_body(lambda: TokenizeResponse(
        count=len(piece.input_ids), max_model_len=card.max_model_len, tokens=list(piece.input_ids),
        token_strs=list(piece.input_tokens) if body.return_token_strs else None),
        large=len(piece.input_ids) > LARGE_BODY_ENTRIES)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    """vLLM's: the text that token ids decode to (special tokens kept). Raises ApiError 400 for an id outside the
    vocabulary, 404, 503."""
    await _served(request, body)
    _refuse(body)
    if not body.tokens:
        return DetokenizeResponse(prompt="")
    ids = OrchestratorRequest(None, None, (), {}, False, False, prompt_token_ids=tuple(body.tokens), input_tokens=False)
    try:
        return DetokenizeResponse(prompt=(await _prompt_tokens(request, ids)).prompt_text)
    except ApiError as exc:  # the orchestrator names its input, which this request sent as tokens
        if exc.status != 400 or not exc.message.startswith("prompt_token_ids: "):
            raise
        raise ApiError(400, "tokens: " + exc.message.removeprefix("prompt_token_ids: "), param="tokens") from None


async def _prompt_tokens(request: Request, prompt: OrchestratorRequest) -> ResponsePiece:
    """The orchestrator's ``tokenize_only`` response to ``prompt`` (its http(s) media fetched first). Raises ApiError
    (400, 503, 499 when the client went away)."""
    state: ApiState = request.app.state.api
    if needs_fetch(prompt):
        prompt, = await _unless_disconnected(request, _media_fetched(state.fetcher, [prompt]))
    return await _unless_disconnected(request, state.orchestrator.tokenize(prompt))


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    """A chat completion, whole or streamed (the module docstring); errors as ``errors`` says."""
    served = await _served(request, body)
    _refuse(body)
    choice = body.tool_choice_asked
    shape = ChatShape(served, body.return_token_ids, body.top_logprobs_asked,
                      body.choices_per_prompt, body.continuous_usage, body.echoed, choice and ToolReplies(choice))
    try:
        return await _generate(request, body, [chat_request(body)], shape)
    except ApiError as exc:  # the reply's schema is the tools' (backends/openai/tools.py)
        raise schema_error(exc, body.tools, choice) from None


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    """A completion of one or more text prompts, whole or streamed."""
    served = await _served(request, body)
    _refuse(body)
    shape = CompletionShape(served, body.return_token_ids, body.top_logprobs_asked,
                            body.choices_per_prompt, body.prompts if body.echo else None, body.echo_only,
                            body.continuous_usage)
    return await _generate(request, body, completion_requests(body), shape)


def _refuse(body: GenerationRequest | TokenizeRequest | DetokenizeRequest) -> None:
    """Raises ApiError 400 naming the field ``body.refusal()`` refuses, before anything is built from ``body``."""
    if (refusal := body.refusal()) is not None:
        raise ApiError(400, refusal[1], param=refusal[0])


async def _served(request: Request, body: GenerationRequest) -> str:
    """The served model's name, which ``body`` must name when it names one (vLLM takes a request without ``model``, or
    with an empty one, as the served model's). Raises ApiError 404 (another model), 503."""
    card = await request.app.state.api.model_card()
    if body.model and not await request.app.state.api.serves(body.model):
        raise _unknown_model(body.model, card.id)
    return card.id


async def _generate(request: Request, body: GenerationRequest, prompts: list[OrchestratorRequest],
                    shape: ChatShape | CompletionShape):
    """Fetch http(s) media, send the prompts' requests (once per choice: ``choices``), answer in ``shape``'s bodies
    (``body``'s fields checked: ``_refuse``). Raises ApiError (400 bad input, 503, 500)."""
    state: ApiState = request.app.state.api
    marks = ApiMarks(per_token=body.return_timeline)
    if 0 < state.config.max_requests < len(prompts) * shape.n:  # its choices run at once, or not at all (choices)
        what, param = ("choices", "n") if shape.n > 1 else ("prompts", "prompt")
        raise ApiError(400, f"{param}: {len(prompts) * shape.n} {what} at once, more than the "
                            f"{state.config.max_requests} requests this server takes at once (--openai-max-requests)",
                       param=param)
    if any(needs_fetch(prompt) for prompt in prompts):  # a fetch outlives no client
        prompts = await _unless_disconnected(request, _media_fetched(state.fetcher, prompts))
    marks.mark("api_sent")
    pieces = merged(state.orchestrator, prompts, shape.n)
    if not body.stream:
        async with contextlib.aclosing(pieces):
            replies = await _unless_disconnected(request, _gathered(pieces, len(prompts) * shape.n))
        replies[0].timeline = marks.into(replies[0].timeline)
        return await _whole_body(shape, replies)
    try:
        first = await _unless_disconnected(request, anext(pieces))
    except BaseException:
        await pieces.aclose()
        raise
    marks.mark("api_first_response")
    return EventSourceResponse(_events(first, pieces, shape, body.include_usage, marks), sep="\n",
                               shutdown_grace_period=state.config.shutdown_grace_s)


async def _media_fetched(fetcher: MediaFetcher, prompts: list[OrchestratorRequest]) -> list[OrchestratorRequest]:
    """``prompts`` with their http(s) media fetched (``MediaFetcher.resolve``), one after another."""
    return [await fetcher.resolve(prompt) for prompt in prompts]


async def _whole_body(shape: ChatShape | CompletionShape, replies: list[Reply]) -> Response:
    """The whole body of ``replies`` in ``shape``, written by pydantic (in Rust; FastAPI's own encoding of a returned
    model walks it in Python: 855 ms against 36 for a 4,096-token prompt echoed with 20 top tokens a token, 10 MB);
    when they hold over ``LARGE_BODY_ENTRIES`` log-probability entries, on the bulk thread (``bulk``) and in slices
    (``sliced_json``), and sent in pieces, so that the event loop serving the process's other requests does not wait
    for it (bench/big_reply_stall.py)."""
    entries = sum(len(reply.logprobs) + len(reply.prompt_logprobs or ()) for reply in replies)
    return await _model_body(lambda: shape.whole(replies), large=entries > LARGE_BODY_ENTRIES)


async def _model_body(make: Callable[[], BaseModel], large: bool) -> Response:
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


async def _events(first: tuple[int, ResponsePiece], pieces: AsyncIterator[tuple[int, ResponsePiece]], shape,
                  include_usage: bool, marks: ApiMarks):
    """The stream's events (dicts for sse-starlette); closing it (the client went away) cancels the request. The
    piece with the request's timeline (choice 0's last) gets ``marks`` joined to it."""
    try:
        marks.mark("api_first_chunk")
        yield {"data": await _chunk_data(shape, first, marks)}  # a choice's first chunk: always one
        async for item in pieces:
            if (data := await _chunk_data(shape, item, marks)) is not None:
                yield {"data": data}
        counts = shape.streamed_usage()
        if include_usage and counts is not None:
            yield {"data": shape.usage_chunk(counts).model_dump_json()}
    except ApiError as exc:
        yield {"data": json.dumps(exc.body())}
    finally:
        await pieces.aclose()
    yield {"data": "[DONE]"}


async def _chunk_data(shape, item: tuple[int, ResponsePiece], marks: ApiMarks) -> str | None:
    """The chunk of ``item`` as JSON text (:func:`one_line`), made on the bulk thread when it holds over
    ``LARGE_BODY_ENTRIES`` log-probability entries (a streamed echo's first chunk carries its prompt's), as
    ``_whole_body`` makes bodies; None where ``shape`` sends no chunk for it (a tool call's text not yet a call's)."""
    if shape.chunk_entries(*item) > LARGE_BODY_ENTRIES:
        return await in_bulk_thread(lambda: _line(_chunk(shape, item, marks), sliced=True))
    return _line(_chunk(shape, item, marks), sliced=False)


def _line(chunk: BaseModel | None, sliced: bool) -> str | None:
    """``chunk``'s JSON text (``sliced``: by ``sliced_json``) on one line, or None for no chunk."""
    return None if chunk is None else one_line(sliced_json(chunk).decode() if sliced else chunk.model_dump_json())


# Line breaks to str.splitlines() but not to the SSE format (whose lines end at CR, LF or CRLF), which pydantic
# writes as they are: a token's text may hold them.
_SPLITLINES_ONLY = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def one_line(json_text: str) -> str:
    """``json_text`` with U+0085, U+2028 and U+2029 written as JSON escapes (they can only be inside its strings,
    where the escape means the same), so that a client splitting the stream with ``str.splitlines`` (httpx's
    ``aiter_lines``) still reads each event's JSON whole (a fresh user's client, 2026-12-06)."""
    return json_text if json_text.isascii() else json_text.translate(_SPLITLINES_ONLY)


def _chunk(shape, item: tuple[int, ResponsePiece], marks: ApiMarks) -> ChatCompletionChunk | Completion | None:
    index, piece = item
    if index == 0:  # the timeline is choice 0's
        marks.chunk(len(piece.token_ids))  # with return_timeline the orchestrator sends them (convert.py)
        if piece.timeline is not None:
            piece = dataclasses.replace(piece, timeline=marks.into(piece.timeline))
    return shape.chunk(index, piece)


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
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
