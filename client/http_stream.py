"""HTTP client for Triton's generate extension: ``POST /v2/models/<model>/generate_stream`` (SSE).

Standard library only. The request body is one JSON object whose fields are the model's inputs
(Triton turns a JSON scalar into a [1] tensor and a JSON list into a [n] tensor). Raw bytes cannot
travel in JSON, so media go by ``video_url`` / ``image_url`` (paths the server may read).

Each response is one SSE event ``data: {json}`` whose fields are the response's outputs; Triton
writes a one-element output as a scalar and a longer one as a list. A failed response is an event
``data: {"error": "..."}`` (HTTP status 200 if an earlier response succeeded, 400 if it is the
first); a request rejected before inference is a plain 400 JSON ``{"error": "..."}``.
"""
from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from typing import Callable, Iterable, Iterator, Sequence

from client.api import DEFAULT_MODEL, GenerationResult, ServerError, _Collector
from client.pieces import ResponsePiece, piece_from_outputs, with_prompt

DEFAULT_HTTP_URL = "127.0.0.1:8000"


def iter_sse_data(lines: Iterable[bytes]) -> Iterator[str]:
    """Yields the data of each server-sent event (its ``data:`` lines joined by newlines).

    Follows the SSE rules that matter here: an event ends at a blank line, one space after the
    colon is dropped, comment lines (``:``) and other fields are ignored, a last event without a
    trailing blank line still counts.
    """
    data: list[str] = []
    for raw in lines:
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def _one(value):
    if isinstance(value, list):
        return value[-1] if value else None
    return value


def piece_from_event(event: dict) -> ResponsePiece:
    """One generate_stream event -> :class:`ResponsePiece`; raises ServerError for an error event."""
    if "error" in event:
        raise ServerError(str(event["error"]))
    text = event.get("text_output", "")
    if isinstance(text, list):
        text = "".join(str(t) for t in text)
    ids = event.get("output_ids")
    ids = () if ids is None else tuple(int(i) for i in ids) if isinstance(ids, list) else (int(ids),)
    piece = piece_from_outputs(str(text).encode(), ids, False, lambda name: _one(event.get(name)))
    prompt_ids = event.get("input_ids")  # return_input_ids' first response, a tokenize_only request's
    return with_prompt(piece, prompt_ids if prompt_ids is None or isinstance(prompt_ids, list) else [prompt_ids])


def request_body(
    text: str,
    *,
    video_url: str | Sequence[str] | None = None,
    image_url: str | Sequence[str] | None = None,
    sampling: dict | None = None,
    stream: bool = True,
    return_output_ids: bool = False,
) -> dict:
    """The generate_stream JSON body: inputs as plain fields, ``sampling_parameters`` as a JSON string."""
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    body: dict = {"text_input": text, "sampling_parameters": json.dumps(sampling or {}), "stream": bool(stream)}
    for name, value in (("video_url", video_url), ("image_url", image_url)):
        if value is not None:
            body[name] = [value] if isinstance(value, str) else [str(v) for v in value]
    if return_output_ids:
        body["return_output_ids"] = True
    if not stream:  # the reply alone, as api.request_tensors asks by default
        body["exclude_input_in_output"] = True
    return body


def _error_from_body(raw: bytes, status: int) -> str:
    """The ``error`` message of a rejected request, whose body is JSON or one SSE event."""
    text = raw.decode("utf-8", errors="replace").strip()
    for candidate in [*iter_sse_data(text.encode().splitlines(keepends=True)), text]:
        try:
            obj = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(obj, dict) and "error" in obj:
            return str(obj["error"])
    return f"HTTP {status}: {text[:500]}"


def generate_stream_http(
    text: str,
    *,
    url: str = DEFAULT_HTTP_URL,
    model: str = DEFAULT_MODEL,
    video_url: str | Sequence[str] | None = None,
    image_url: str | Sequence[str] | None = None,
    sampling: dict | None = None,
    return_output_ids: bool = False,
    timeout_s: float = 600.0,
    on_text: Callable[[str], None] | None = None,
) -> GenerationResult:
    """One streamed generation over HTTP/SSE; times in ms from just before the request is sent.

    ``url`` is ``host:port`` (an ``http://`` prefix is accepted). Raises ServerError with the
    server's message on an error (event or HTTP status), or when the stream ends without its final
    event (one with a finish reason: the connection dropped); TimeoutError when the stream has not
    ended within ``timeout_s`` seconds (checked per event and by the socket timeout).
    """
    base = url if url.startswith(("http://", "https://")) else f"http://{url}"
    body = json.dumps(request_body(text, video_url=video_url, image_url=image_url, sampling=sampling,
                                   return_output_ids=return_output_ids)).encode()
    req = urllib.request.Request(f"{base}/v2/models/{model}/generate_stream", data=body, method="POST",
                                 headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
    t0 = time.perf_counter()
    deadline = t0 + timeout_s
    collector = _Collector(t0, on_text)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            for data in iter_sse_data(resp):
                arrived = time.perf_counter()
                try:
                    event = json.loads(data)
                except ValueError:
                    raise ServerError(f"unparsable event from the server: {data[:200]!r}") from None
                collector.add(arrived, piece_from_event(event))
                if arrived > deadline:
                    raise TimeoutError(f"generate_stream of {model} not finished within {timeout_s} s")
    except urllib.error.HTTPError as e:
        raise ServerError(_error_from_body(e.read(), e.code)) from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, TimeoutError):
            raise TimeoutError(f"no data from {base} within {timeout_s} s") from None
        raise ServerError(f"cannot reach {base}: {e.reason}") from None
    except http.client.HTTPException as e:  # e.g. a gRPC port: what answers is not HTTP/1.1
        raise ServerError(f"{base} did not answer as an HTTP server ({type(e).__name__}: {e}); is it Triton's "
                          "HTTP port (default 8000), not its gRPC one?") from None
    result = collector.finish()
    if result.finish_reason is None:
        raise ServerError(f"the stream from {base} ended before its final event ({result.num_responses} events)")
    return result
