"""The API's request-body limit (``--max-body-bytes``, ``ApiConfig.max_body_bytes``): a body larger than the limit is
answered 413 with an OpenAI-shaped error (``code`` ``request_too_large``) before it is read, when its Content-Length
says so, or as soon as the bytes read pass the limit (a chunked body: the app is told the client has gone and its
answer is replaced by the 413), instead of being read whole, converted and sent to tritonserver for the orchestrator
to refuse (a 300 MiB body took 10 s and 1.09 GB in one API worker before this). The rest of a refused body is read and
dropped, never kept (at most ``LINGER_S``, ``LINGER_IDLE_S`` without a byte), so that the client, still sending, reads
the 413; a client that asked ``Expect: 100-continue`` gets it at once, its body unsent. An ASGI middleware."""
from __future__ import annotations

import asyncio
import contextlib
from typing import Awaitable, Callable

from backends.openai.errors import ApiError

LINGER_S = 30.0  # the longest the rest of a refused body is read and dropped (seconds; nginx's lingering_time)
LINGER_IDLE_S = 5.0  # ... and the longest wait for its next bytes (seconds; nginx's lingering_timeout)

Scope = dict
Message = dict
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def too_large(max_bytes: int) -> ApiError:
    """The error for a body over ``max_bytes`` (bytes)."""
    return ApiError(413, f"the request body is larger than this API's limit of {max_bytes} bytes (the launcher's "
                         "--openai-max-body-bytes; send large media by path or URL)", code="request_too_large")


class BodyLimit:
    """ASGI middleware: HTTP requests whose body passes ``max_bytes`` (bytes) are answered 413."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and (len(length) > 18 or int(length) > self.max_bytes):
            # a client that expects 100-continue waits for it: nothing to drain
            await self._refuse(scope, receive, send, drain=headers.get(b"expect", b"").lower() != b"100-continue")
            return
        read, over, ended, answered = 0, False, False, False

        async def limited() -> Message:
            nonlocal read, over, ended
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                ended = not message.get("more_body", False)
                if read > self.max_bytes:  # the app reads no more: to it the client has gone
                    over = True
                    return {"type": "http.disconnect"}
            return message

        async def refuse() -> None:
            nonlocal answered
            if not answered:
                answered = True
                await self._refuse(scope, receive, send, drain=not ended)

        async def answer(message: Message) -> None:
            if over:  # whatever the app answers to a body it could not read, the client gets the 413
                await refuse()
            else:
                await send(message)

        try:
            await self.app(scope, limited, answer)
        except Exception:
            if not over:
                raise
        if over:
            await refuse()

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, drain: bool) -> None:
        """The 413, after reading and dropping what is left of the body when ``drain``."""
        if drain:
            await _drain(receive)
        await too_large(self.max_bytes).response()(scope, receive, send)


async def _drain(receive: Receive, linger_s: float = LINGER_S, idle_s: float = LINGER_IDLE_S) -> None:
    """Read what is left of the body and drop it, for at most ``linger_s`` seconds in all and ``idle_s`` seconds
    without a byte (nginx's lingering_time and lingering_timeout): a client still sending a body gets a connection
    reset instead of the 413 when the server answers and closes first."""
    async def rest() -> None:
        while True:
            message = await asyncio.wait_for(receive(), idle_s)
            if message["type"] != "http.request" or not message.get("more_body", False):
                return

    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(rest(), linger_s)
