"""The API's keys (``--api-key``, ``ApiConfig.api_keys``; vLLM's option): with keys set, every request but the probes'
(:data:`PUBLIC_PATHS`, and CORS preflights, ``OPTIONS``) must carry ``Authorization: Bearer KEY`` with one of them,
else it is answered 401 (``code`` ``invalid_api_key``, OpenAI's for a wrong key) before its body is read. The keys
reach the API process by its environment (:data:`ENV`), not its command line, which ``ps`` shows to every user.
An ASGI middleware.
"""
from __future__ import annotations

import hashlib
import hmac
import os

from backends.openai.errors import ApiError

ENV = "UNIFIEDSERVE_API_KEY"  # the keys, comma-separated (vLLM's VLLM_API_KEY)
# as vLLM leaves them open
PUBLIC_PATHS = ("/health", "/ping", "/version", "/metrics", "/docs", "/redoc", "/openapi.json")


def keys_from_env() -> tuple[str, ...]:
    """The keys :data:`ENV` holds (none where it is unset or empty)."""
    return tuple(key for key in os.environ.get(ENV, "").split(",") if key)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class ApiKeys:
    """ASGI middleware: HTTP requests without one of ``keys`` (non-empty strings) are answered 401 (module
    docstring). Raises ValueError for no keys."""

    def __init__(self, app, keys: tuple[str, ...]):
        if not keys:
            raise ValueError("ApiKeys needs at least one key")
        self.app, self._digests = app, tuple(_digest(key) for key in keys)

    def allows(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header's value carries one of the keys (the scheme in any case, as HTTP's
        are; every key compared in constant time: digests of equal length)."""
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            return False
        sent = _digest(key.strip())
        return any([hmac.compare_digest(sent, digest) for digest in self._digests])

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or _public(scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        authorization = headers.get(b"authorization")
        if self.allows(authorization.decode("latin-1") if authorization is not None else None):
            await self.app(scope, receive, send)
            return
        error = ApiError(401, "this server needs an API key: send one of its keys as 'Authorization: Bearer KEY' "
                              "(the SDKs' api_key)" if authorization is None else
                              "the API key sent is not one of this server's", code="invalid_api_key")
        await error.response()(scope, receive, send)


def _public(path: str) -> bool:
    return any(path == public or path.startswith(public + "/") for public in PUBLIC_PATHS)
