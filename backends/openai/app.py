"""The OpenAI-compatible HTTP API (FastAPI): ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
``/health``, and vLLM's ``/tokenize``, ``/detokenize``, ``/version``, in front of the orchestrator model of a
tritonserver (``orchestrator_client``); ``/v1/responses`` (``responses_api.route``) and ``/metrics``
(``metrics_route``) are routers of their own.

The generation routes' common path (the model's name and the fields checked, media fetched, the orchestrator's
responses answered whole or streamed): ``generation``.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware

from backends.openai import metrics_route
from backends.openai.api_keys import ApiKeys
from backends.openai.body_limit import BodyLimit
from backends.openai.config import ApiConfig
from backends.openai.convert import OrchestratorRequest, chat_request, completion_requests
from backends.openai.errors import ApiError, install_handlers
from backends.openai.generation import (LARGE_BODY_ENTRIES, generate, media_fetched, model_body, refuse, served,
                                        unknown_model, unless_disconnected)
from backends.openai.media_fetch import MediaFetcher, needs_fetch
from backends.openai.orchestrator_client import OrchestratorClient
from backends.openai.replica_health import ReplicaHealth
from backends.openai.responses import ChatShape, CompletionShape
from backends.openai.responses_api import route as responses_route
from backends.openai.response_schemas import ModelCard, ModelList
from backends.openai.request_ids import RequestIdHeaders, reply_id
from backends.openai.schemas import ChatCompletionRequest, CompletionRequest
from backends.openai.tool_calls import ToolReplies, schema_error
from backends.openai.tokenize_schemas import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest,
                                              TokenizeResponse)
from backends.openai.version import VERSION
from client.pieces import ResponsePiece


router = APIRouter()


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
    app.include_router(responses_route.router)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    if config.api_keys:  # added after the body limit, so it runs before it: a refused request's body is never read
        app.add_middleware(ApiKeys, keys=config.api_keys)
    if config.allowed_origins:  # a preflight is answered here, every answer (a 401 too) marked
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    if config.request_id_headers:  # the outermost: every answer, a 401 or a preflight's too
        app.add_middleware(RequestIdHeaders)
    return app


@router.get("/health")
@router.get("/ping")  # vLLM's too (SageMaker's health check); a route per method, each with its own operation id
@router.post("/ping")
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
        raise unknown_model(model, cards[0].id)
    return next((card for card in cards if card.id == model), cards[0])


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
    made off the event loop (``model_body``): a 1-MiB prompt's 786k ids and token strings took about 130 ms to
    write on the CPU machine, a pause of every stream the process serves."""
    card = await request.app.state.api.model_card()
    await served(request, body)
    refuse(body)
    prompt = dataclasses.replace(body.orchestrator_request(), input_tokens=body.return_token_strs)
    piece = await _prompt_tokens(request, prompt)
    return await model_body(lambda: TokenizeResponse(
        count=len(piece.input_ids), max_model_len=card.max_model_len, tokens=list(piece.input_ids),
        token_strs=list(piece.input_tokens) if body.return_token_strs else None),
        large=len(piece.input_ids) > LARGE_BODY_ENTRIES)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    """vLLM's: the text that token ids decode to (special tokens kept). Raises ApiError 400 for an id outside the
    vocabulary, 404, 503."""
    await served(request, body)
    refuse(body)
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
        prompt, = await unless_disconnected(request, media_fetched(state.fetcher, [prompt]))
    return await unless_disconnected(request, state.orchestrator.tokenize(prompt))


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    """A chat completion, whole or streamed (``generation``); errors as ``errors`` says."""
    name = await served(request, body)
    refuse(body)
    choice = body.tool_choice_asked
    shape = ChatShape(name, body.return_token_ids, body.top_logprobs_asked,
                      body.choices_per_prompt, body.continuous_usage, body.echoed, choice and ToolReplies(choice),
                      request_id=reply_id(request, body.request_id))
    try:
        return await generate(request, body, [chat_request(body)], shape)
    except ApiError as exc:  # the reply's schema is the tools' (backends/openai/tools.py)
        raise schema_error(exc, body.tools, choice) from None


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    """A completion of one or more text prompts, whole or streamed."""
    name = await served(request, body)
    refuse(body)
    shape = CompletionShape(name, body.return_token_ids, body.top_logprobs_asked,
                            body.choices_per_prompt, body.prompts if body.echo else None, body.echo_only,
                            body.continuous_usage, request_id=reply_id(request, body.request_id))
    return await generate(request, body, completion_requests(body), shape)
