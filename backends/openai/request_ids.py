"""Request ids as vLLM's OpenAI server gives them: a reply's ``id`` after its ``chatcmpl-``/``cmpl-`` prefix
(:func:`reply_id`), and, with ``--enable-request-id-headers``, an ``X-Request-Id`` header on every answer
(:class:`RequestIdHeaders`; vLLM's ``XRequestIdMiddleware``)."""
from __future__ import annotations

import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "X-Request-Id"


def reply_id(request: Request, body_request_id: str | None) -> str | None:
    """The reply's id after its prefix, as vLLM's ``_base_request_id``: the request's ``X-Request-Id`` header, else
    the body's ``request_id``, else None (a random one)."""
    return request.headers.get(HEADER, body_request_id)


class RequestIdHeaders:
    """Puts an ``X-Request-Id`` header on every HTTP answer: the request's own, else a random hex string (vLLM's
    ``--enable-request-id-headers``; as there, not the reply's ``id`` when the request sent none)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get(HEADER) or uuid.uuid4().hex

        async def marked(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[HEADER] = request_id
            await send(message)

        await self.app(scope, receive, marked)
