"""http(s) media (backends/openai/media_fetch.py) against a real HTTP server on 127.0.0.1 (http.server)."""
from __future__ import annotations

import asyncio
import base64
import http.server
import threading
import time

import pytest

from backends.openai.generation import media_fetched, unless_disconnected
from backends.openai.convert import MediaRef, OrchestratorRequest
from backends.openai.errors import ApiError
from backends.openai.media_fetch import MediaFetcher

FILES = {"/a.png": (b"\x89PNG" + bytes(range(256)) * 4, "image/png"), "/big.mp4": (b"\x00" * 5000, "video/mp4")}


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/slow":  # a byte every 0.2 s: each read is quick, the whole body never ends
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            try:
                for _ in range(200):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:  # the fetcher gave up
                pass
            return
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/a.png")
            self.end_headers()
            return
        if self.path not in FILES:
            self.send_error(404)
            return
        body, mime = FILES[self.path]
        self.send_response(200)
        self.send_header("Content-Type", mime)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def base_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _request(*urls: str) -> OrchestratorRequest:
    media = tuple(MediaRef("image", url, f"messages[0].content[{j}].image_url") for j, url in enumerate(urls))
    return OrchestratorRequest(None, "[]", media, {}, False, False)


def _resolve(request: OrchestratorRequest, allow: bool = True, max_bytes: int = 4096,
             timeout_s: float = 10.0) -> OrchestratorRequest:
    async def run():
        fetcher = MediaFetcher(allow, max_bytes, {"image": timeout_s, "video": 10 * timeout_s})
        try:
            return await fetcher.resolve(request)
        finally:
            await fetcher.close()

    return asyncio.run(run())


def test_fetched_bytes_become_a_data_url_and_other_urls_pass(base_url):
    resolved = _resolve(_request("data:image/png;base64,AAAA", f"{base_url}/a.png", "file:///data/b.png",
                                 f"{base_url}/moved"))
    urls = [m.url for m in resolved.media]
    expected = "data:image/png;base64," + base64.b64encode(FILES["/a.png"][0]).decode()
    assert urls == ["data:image/png;base64,AAAA", expected, "file:///data/b.png", expected]
    assert [m.where for m in resolved.media] == [m.where for m in _request("", "", "", "").media]


@pytest.mark.parametrize("path,allow,words", [
    ("/a.png", False, "messages[0].content[0].image_url: http(s) URLs are not fetched by this server"),
    ("/big.mp4", True, "messages[0].content[0].image_url: http://127.0.0.1"),
    ("/missing", True, "answered HTTP 404"),
])
def test_refused_fetches_name_the_part(base_url, path, allow, words):
    with pytest.raises(ApiError) as error:
        _resolve(_request(f"{base_url}{path}"), allow=allow)
    assert error.value.status == 400 and words in error.value.message, error.value.message
    if path == "/big.mp4":
        assert "over the limit of 4096 bytes" in error.value.message


def test_an_unreachable_host_is_a_400_naming_the_part():
    with pytest.raises(ApiError) as error:
        _resolve(_request("http://127.0.0.1:9/x.png"))  # port 9 (discard): nothing listens
    assert error.value.status == 400 and "could not fetch" in error.value.message


@pytest.mark.parametrize("url", ["http://[::1", "http://[zz]/x", "https://example.com:abc/"])
def test_a_malformed_url_is_a_400_naming_the_part(url):
    """httpx refuses these with InvalidURL (or the standard library's ValueError), which are no httpx.HTTPError: they
    were a bare 500 (text/plain), which OpenAI's SDK retried twice."""
    with pytest.raises(ApiError) as error:
        _resolve(_request(url))
    assert error.value.status == 400, error.value.message
    assert error.value.message.startswith(f"messages[0].content[0].image_url: could not fetch {url}: ")


def test_a_fetch_that_never_ends_is_refused_at_the_deadline(base_url):
    """httpx's timeout bounds each read; the fetcher bounds the whole fetch (a trickling server once held one open
    for minutes)."""
    started = time.monotonic()
    with pytest.raises(ApiError) as error:
        _resolve(_request(f"{base_url}/slow"), max_bytes=1 << 20, timeout_s=1.0)
    assert time.monotonic() - started < 5.0
    assert error.value.status == 400 and "messages[0].content[0].image_url: could not fetch" in error.value.message
    assert "within 1 s (the API's --http-image-timeout)" in error.value.message, error.value.message


def test_a_video_has_its_own_deadline(base_url):
    """Images and videos are bounded apart, as vLLM bounds them (5 s and 30 s by default)."""
    part = MediaRef("video", f"{base_url}/slow", "messages[0].content[0].video_url")
    video = OrchestratorRequest(None, "[]", (part,), {}, False, False)
    started = time.monotonic()
    with pytest.raises(ApiError) as error:
        _resolve(video, max_bytes=1 << 20, timeout_s=0.2)  # the video's: 2 s
    assert 1.5 < time.monotonic() - started < 6.0
    assert "within 2 s (the API's --http-video-timeout)" in error.value.message, error.value.message


class _Leaving:
    """A request whose client goes away after ``after_s`` seconds (the ASGI messages ``unless_disconnected`` reads)."""

    def __init__(self, after_s: float):
        self.after_s = after_s

    async def receive(self) -> dict:
        await asyncio.sleep(self.after_s)
        return {"type": "http.disconnect"}


def test_a_fetch_is_cancelled_when_its_client_leaves(base_url):
    async def run():
        fetcher = MediaFetcher(True, 1 << 20, {"image": 30.0, "video": 30.0})
        try:
            work = media_fetched(fetcher, [_request(f"{base_url}/slow")])
            with pytest.raises(ApiError) as error:
                await unless_disconnected(_Leaving(0.5), work)
            return error.value.status
        finally:
            await fetcher.close()

    started = time.monotonic()
    status = asyncio.run(run())
    assert status == 499 and time.monotonic() - started < 5.0
