"""http(s) ``image_url`` / ``video_url`` parts: refused, or, where the operator allows them, fetched by the API
process (``httpx``) and passed on as base64 ``data:`` URLs, which the orchestrator reads like any other (the
tritonserver process fetches nothing). ``data:``, ``file://`` and plain paths pass through unchanged: the
orchestrator checks them (base64, the allowed media folders, sizes).
"""
from __future__ import annotations

import asyncio
import base64

import httpx

from backends.openai.convert import MediaRef, OrchestratorRequest
from backends.openai.errors import ApiError


class MediaFetcher:
    """Resolves a request's http(s) media. ``allow``: fetch them (else refuse); at most ``max_bytes`` bytes per
    item, each item's whole fetch (connecting, redirects, every byte) within ``timeouts_s[kind]`` seconds (``image``,
    ``video``), as vLLM bounds its fetches (``VLLM_IMAGE_FETCH_TIMEOUT``, 5 s, ``VLLM_VIDEO_FETCH_TIMEOUT``, 30 s):
    httpx's own timeout bounds each network operation only, so a server sending a byte every few seconds held a
    fetch open for minutes. Redirects are followed (at most 5)."""

    def __init__(self, allow: bool, max_bytes: int, timeouts_s: dict[str, float]):
        self.allow, self.max_bytes, self.timeouts_s = allow, max_bytes, timeouts_s
        self._client = httpx.AsyncClient(follow_redirects=True, max_redirects=5)

    async def resolve(self, request: OrchestratorRequest) -> OrchestratorRequest:
        """``request`` with each http(s) URL replaced by a ``data:`` URL of the fetched bytes.

        Raises ApiError 400 naming the part (``messages[i].content[j].image_url``): http(s) not allowed, an answer
        other than 200, over ``max_bytes``, not fetched within its kind's timeout, or a network failure.
        """
        if not needs_fetch(request):
            return request
        return request.with_media(tuple([await self._fetched(m) if _is_http(m.url) else m for m in request.media]))

    async def _fetched(self, media: MediaRef) -> MediaRef:
        if not self.allow:
            raise ApiError(400, f"{media.where}: http(s) URLs are not fetched by this server (started without "
                                "--openai-allow-http-media); send a data: URL, or a file:// path under its allowed "
                                "media folders", param="messages")
        timeout_s = self.timeouts_s[media.kind]
        try:
            return await asyncio.wait_for(self._download(media, timeout_s), timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(400, f"{media.where}: could not fetch {media.url[:200]} within {timeout_s:g} s (the "
                                f"API's --http-{media.kind}-timeout)", param="messages") from None

    async def _download(self, media: MediaRef, timeout_s: float) -> MediaRef:
        try:
            async with self._client.stream("GET", media.url, timeout=timeout_s) as response:
                if response.status_code != 200:
                    raise ApiError(400, f"{media.where}: fetching {media.url[:200]} answered HTTP "
                                        f"{response.status_code}", param="messages")
                length = response.headers.get("content-length", "")
                declared = int(length) if length.isdigit() else 0
                data = bytearray()
                if declared <= self.max_bytes:
                    async for chunk in response.aiter_bytes():
                        data += chunk
                        if len(data) > self.max_bytes:
                            break
                if max(declared, len(data)) > self.max_bytes:
                    raise ApiError(400, f"{media.where}: {media.url[:200]} is over the limit of {self.max_bytes} "
                                        "bytes", param="messages")
                mime = response.headers.get("content-type", "application/octet-stream").split(";")[0].strip()
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:  # InvalidURL ("http://[::1", a port "abc") is
            # no HTTPError; some carry no message (a ReadTimeout's is empty): the name alone then
            reason = ": ".join(part for part in (type(exc).__name__, str(exc)) if part)
            raise ApiError(400, f"{media.where}: could not fetch {media.url[:200]}: {reason}",
                           param="messages") from None
        return MediaRef(media.kind, f"data:{mime};base64,{base64.b64encode(data).decode()}", media.where)

    async def close(self) -> None:
        await self._client.aclose()


def needs_fetch(request: OrchestratorRequest) -> bool:
    """Whether ``request`` holds http(s) media (``MediaFetcher.resolve`` has work to do)."""
    return any(_is_http(m.url) for m in request.media)


def _is_http(url: str) -> bool:
    return url[:7].lower() == "http://" or url[:8].lower() == "https://"
