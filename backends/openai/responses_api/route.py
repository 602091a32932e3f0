"""``POST /v1/responses``: OpenAI's Responses API as vLLM 0.26 serves it (``vllm/entrypoints/openai/responses/``),
run as the chat completion it amounts to (``request.ResponsesRequest.chat_request``) through the chat's path
(``generation.generate``) and answered as a Response object or its stream of events (``shape``). Errors have the
other routes' shape and statuses (``errors``); API keys and the body limit are the app's, as for every route.

Nothing is stored, as by vLLM 0.26 without ``VLLM_ENABLE_RESPONSES_API_STORE=1``: the routes that read a stored
response (OpenAI's retrieve, delete, cancel and input items) answer that it is not found (:func:`not_stored`).
"""
from __future__ import annotations

from fastapi import APIRouter, Request

from backends.openai.convert import chat_request
from backends.openai.errors import ApiError
from backends.openai.generation import generate, refuse, served
from backends.openai.responses_api.request import ResponsesRequest
from backends.openai.responses_api.shape import ResponsesShape
from orchestrator.shown import shown

router = APIRouter()


def not_stored(response_id: str, param: str, fix: str = "") -> ApiError:
    """The 404 for a response this server would have to have stored: vLLM 0.26's answer without its store
    (``serving.py``, ``_make_not_found_error``: "Response with id '...' not found.", invalid_request_error), its
    ``param`` the field that named it, why, and ``fix``."""
    return ApiError(404, f"Response with id {shown(response_id)} not found: this server stores no responses (as vLLM "
                         f"0.26 keeps none unless started with VLLM_ENABLE_RESPONSES_API_STORE=1){fix}", param=param,
                    code="response_not_found")


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request):
    """A response, whole (the Response object) or streamed (its events, ``shape``). Raises ApiError: 404 for another
    model, or for a ``previous_response_id`` (:func:`not_stored`); 400 naming the field this server refuses
    (``ResponsesRequest.refusal``) or the orchestrator does (said as this request sent it:
    ``ResponsesRequest.named``); 503, 500 as a chat's."""
    name = await served(request, body)
    if body.previous_response_id is not None:
        raise not_stored(body.previous_response_id, "previous_response_id", "; send the conversation in input")
    refuse(body)
    chat = body.chat_request()
    try:
        refuse(chat)
        return await generate(request, chat, [chat_request(chat)], ResponsesShape(body, name))
    except ApiError as exc:
        raise body.named(exc) from None


@router.get("/v1/responses/{response_id}")
@router.delete("/v1/responses/{response_id}")
@router.post("/v1/responses/{response_id}/cancel")
@router.get("/v1/responses/{response_id}/input_items")
async def stored_response(response_id: str):
    """OpenAI's retrieve, delete, cancel and input-items routes: a 404 naming ``response_id``
    (:func:`not_stored`), as vLLM 0.26 answers its retrieve and cancel routes without its store (``api_router.py``;
    it has no delete or input-items route: a 405 and a bare 404 there), so that the SDK raises NotFoundError."""
    raise not_stored(response_id, "response_id")
