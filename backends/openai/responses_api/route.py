"""``POST /v1/responses``: OpenAI's Responses API as vLLM 0.26 serves it (``vllm/entrypoints/openai/responses/``),
run as the chat completion it amounts to (``request.ResponsesRequest.chat_request``) through the chat's path
(``generation.generate``) and answered as a Response object or its stream of events (``shape``). Errors have the
other routes' shape and statuses (``errors``); API keys and the body limit are the app's, as for every route.
"""
from __future__ import annotations

from fastapi import APIRouter, Request

from backends.openai.convert import chat_request
from backends.openai.errors import ApiError
from backends.openai.generation import generate, refuse, served
from backends.openai.responses_api.request import ResponsesRequest
from backends.openai.responses_api.shape import ResponsesShape

router = APIRouter()


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request):
    """A response, whole (the Response object) or streamed (its events, ``shape``). Raises ApiError: 404 for another
    model, or for a ``previous_response_id`` (nothing is stored, as by vLLM 0.26 without
    ``VLLM_ENABLE_RESPONSES_API_STORE``: its ``Response with id ... not found``); 400 naming the field this server
    refuses (``ResponsesRequest.refusal``) or the orchestrator does (said as this request sent it:
    ``ResponsesRequest.named``); 503, 500 as a chat's."""
    name = await served(request, body)
    if body.previous_response_id is not None:
        raise ApiError(404, f"previous_response_id: response {body.previous_response_id!r} not found: this server "
                            "stores no responses (as vLLM 0.26 keeps none unless started with "
                            "VLLM_ENABLE_RESPONSES_API_STORE=1); send the conversation in input",
                       param="previous_response_id", code="response_not_found")
    refuse(body)
    chat = body.chat_request()
    try:
        refuse(chat)
        return await generate(request, chat, [chat_request(chat)], ResponsesShape(body, name))
    except ApiError as exc:
        raise body.named(exc) from None
