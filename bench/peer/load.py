"""The peer benchmark's load generator: one client for both systems, over OpenAI's streamed chat API.

Both servers answer ``POST /v1/chat/completions`` with server-sent events; every request here is streamed with
``stream_options.include_usage``, greedy, with ``ignore_eos`` (a fixed output length) and ``return_token_ids``
(vLLM's field, which UnifiedServe takes: each chunk lists its tokens' ids). Per request it records
(:class:`RequestRecord`): the send time (s from the scenario's start), the arrival of every token (s after the
send: a chunk's arrival once per id it lists), hence TTFT and each TBT gap (ms), the prompt and output tokens the
server reports in ``usage`` (and of the prompt's, those it found cached: ``usage.prompt_tokens_details``), and the
error, if any. A token that decodes to no text (half a UTF-8 character) has
no text of its own, so only the ids count tokens; a chunk without ids (a server that ignores the field) counts
as one token when it carries text, and the role-only first chunk as none.

Workloads: :func:`closed_loop` (N streams, each sending its next request as soon as one ends, until told to stop
or out of requests; or sessions: several requests in a row on one stream, as the questions about one clip) and
:func:`open_loop` (each request sent at its own time: a burst at one instant, or :func:`poisson_times` arrivals at
a rate). Media go as ``image_url`` / ``video_url`` parts with ``file://`` URLs (both servers read them from an
allowed folder) or ``data:`` URLs (:func:`media_url`).

``vllm bench serve`` (vLLM's own load generator) cannot send a local 3-minute video from a file nor mix arrivals
of two request kinds; ``bench/peer/crosscheck.py`` runs it beside this generator on one shared text scenario.
"""
from __future__ import annotations

import asyncio
import base64
import json
import mimetypes
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

REQUEST_TIMEOUT_S = 900.0  # a 10-minute video's prefill under load stays well inside


@dataclass(frozen=True)
class ChatRequest:
    """One chat request: ``kind`` names its type for the figures ("text", "image", "video", ...);
    ``parts`` is the last user message's content (OpenAI parts); ``max_tokens`` its fixed output length (tokens);
    ``history`` the conversation's earlier messages (OpenAI message dicts; none: a one-message chat); ``extra``
    more body fields, as (name, value) pairs (``bench/stream_cost.py``'s log probabilities)."""

    kind: str
    parts: tuple[dict, ...]
    max_tokens: int
    history: tuple[dict, ...] = ()
    extra: tuple[tuple[str, object], ...] = ()

    def body(self, model: str, timeline: bool = False, video_kwargs: dict | None = None) -> dict:
        """The JSON body: streamed with usage, greedy, ``ignore_eos`` and ``return_token_ids`` (vLLM's extra
        fields, which UnifiedServe takes); with ``timeline``, UnifiedServe's ``return_timeline``; when the
        conversation holds a video, ``video_kwargs`` as its ``mm_processor_kwargs`` (vLLM's field, which
        UnifiedServe takes: InternVL3's frame count)."""
        messages = [*self.history, {"role": "user", "content": list(self.parts)}]
        video = video_kwargs and any(part.get("type") == "video_url" for m in messages
                                     if isinstance(m["content"], list) for part in m["content"])
        return {"model": model, "messages": messages, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "stream": True,
                "stream_options": {"include_usage": True}, **({"return_timeline": True} if timeline else {}),
                **({"mm_processor_kwargs": dict(video_kwargs)} if video else {}), **dict(self.extra)}


@dataclass(frozen=True)
class Target:
    """A running server: its system (``unifiedserve`` or ``vllm``), its OpenAI API's base URL, the model name
    it serves, and what its requests holding a video carry as ``mm_processor_kwargs`` (``bench.peer.models``; the
    same for both systems). UnifiedServe is asked for each request's timeline (where its time went in the server)
    unless ``timelines`` is false (``run.py --no-timelines``: its figures without the timelines' upkeep)."""

    system: str
    url: str
    model: str
    video_kwargs: dict = field(default_factory=dict)
    timelines: bool = True

    @property
    def timeline(self) -> bool:
        return self.timelines and self.system == "unifiedserve"


@dataclass
class RequestRecord:
    """What one request saw. Times: ``sent_s`` in s from the scenario's start, ``token_s`` in s after the send
    (one per chunk with text); ``ttft_ms`` / ``tbt_ms`` in ms; token counts from the server's ``usage``."""

    kind: str
    sent_s: float
    token_s: list[float] = field(default_factory=list)  # one per token (tokens of one chunk share its time)
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None  # of the prompt's, found in the server's prefix cache (None: not reported)
    done_s: float | None = None  # after the send
    error: str | None = None
    timeline: dict | None = None  # UnifiedServe's record of the request (events in ms since it arrived there)
    sent_clock_s: float | None = None  # the send on time.perf_counter()'s clock (bench.peer.client_loop's stalls')

    @property
    def ttft_ms(self) -> float | None:
        return self.token_s[0] * 1e3 if self.token_s else None

    @property
    def tbt_ms(self) -> list[float]:
        return [(b - a) * 1e3 for a, b in zip(self.token_s, self.token_s[1:])]

    def to_json(self) -> dict:
        """The record with its TTFT (ms) added."""
        return {**asdict(self), "ttft_ms": self.ttft_ms}


def media_url(path: Path, inline: bool = False) -> str:
    """``file://`` URL of ``path``, or with ``inline`` a ``data:`` URL of its bytes (base64)."""
    if not inline:
        return path.resolve().as_uri()
    mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"


def chat_parts(text: str, images: list[str] = (), videos: list[str] = ()) -> tuple[dict, ...]:
    """A user message's parts: the images, the videos (URLs from :func:`media_url`), then the text."""
    return (*({"type": "image_url", "image_url": {"url": u}} for u in images),
            *({"type": "video_url", "video_url": {"url": u}} for u in videos), {"type": "text", "text": text})


def new_client() -> httpx.AsyncClient:
    """An HTTP client without a connection limit (a closed loop of N streams holds N connections)."""
    return httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


def tokens_in(chunk: dict) -> int:
    """Tokens one streamed chunk delivers: its ids, else one if it carries text."""
    choices = chunk.get("choices") or ()
    if any("token_ids" in c for c in choices):
        return sum(len(c.get("token_ids") or ()) for c in choices)
    return int(any((c.get("delta") or {}).get("content") for c in choices))


async def send(client: httpx.AsyncClient, target: Target, request: ChatRequest, start: float) -> RequestRecord:
    """Send ``request`` to ``target`` and read its stream.
    ``start``: the scenario's start (``time.perf_counter()``). An HTTP error, an error event or a broken stream
    is recorded in ``error``, never raised."""
    sent = time.perf_counter()
    record = RequestRecord(request.kind, sent - start, sent_clock_s=sent)
    try:
        body = request.body(target.model, target.timeline, target.video_kwargs)
        async with client.stream("POST", f"{target.url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:500]}"
                return record
            async for line in response.aiter_lines():
                arrived = time.perf_counter() - sent  # before parsing: the client's own cost stays out
                if not line.startswith("data:") or (data := line[5:].strip()) == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = f"error event: {json.dumps(chunk['error'])[:500]}"
                record.token_s += [arrived] * tokens_in(chunk)
                record.timeline = chunk.get("timeline") or record.timeline
                if chunk.get("usage"):
                    record.prompt_tokens = chunk["usage"].get("prompt_tokens")
                    record.output_tokens = chunk["usage"].get("completion_tokens")
                    record.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.done_s = time.perf_counter() - sent
    return record


async def open_loop(target: Target, schedule: list[tuple[float, ChatRequest | tuple[ChatRequest, ...]]],
                    start: float | None = None) -> list[RequestRecord]:
    """Send each ``(time_s, request)`` at ``time_s`` after ``start`` (default: now), whatever is still running; a
    request that is a tuple is a session, whose requests are sent one after another from then. Returns the records
    in schedule order (a session's in its order) once all have ended."""
    start = time.perf_counter() if start is None else start
    async with new_client() as client:
        async def at(time_s: float, session: tuple[ChatRequest, ...]) -> list[RequestRecord]:
            await asyncio.sleep(max(0.0, start + time_s - time.perf_counter()))
            return [await send(client, target, request, start) for request in session]
        sessions = [at(t, r if isinstance(r, tuple) else (r,)) for t, r in schedule]
        return [record for records in await asyncio.gather(*sessions) for record in records]


async def closed_loop(target: Target, streams: int,
                      requests: list[ChatRequest | tuple[ChatRequest, ...]] | ChatRequest,
                      stop: asyncio.Event | None = None, start: float | None = None) -> list[RequestRecord]:
    """``streams`` streams at once, each sending its next request when its last one ends: the requests of
    ``requests`` (a list, shared out in order; an item that is a tuple is a session, whose requests the stream that
    takes it sends one after another) or, given one request, that request again and again until ``stop`` is set (a
    request running then still ends; ``stop`` is read between sessions). Returns the records in the order they
    were sent."""
    start = time.perf_counter() if start is None else start
    queue = [r if isinstance(r, tuple) else (r,) for r in requests] if isinstance(requests, list) else None
    records: list[RequestRecord] = []

    async def stream(client: httpx.AsyncClient) -> None:
        while not (stop is not None and stop.is_set()):
            if queue is not None and not queue:
                return
            for request in queue.pop(0) if queue is not None else (requests,):
                record = RequestRecord(request.kind, 0.0)
                records.append(record)  # now, so the list keeps send order
                sent = await send(client, target, request, start)
                record.__dict__.update(sent.__dict__)

    async with new_client() as client:
        await asyncio.gather(*(stream(client) for _ in range(streams)))
    return records


def poisson_times(rate_rps: float, count: int, seed: int) -> list[float]:
    """``count`` arrival times (s, from 0) of a Poisson process of ``rate_rps`` requests per second: exponential
    gaps from a ``random.Random(seed)``, so both systems get the same arrivals. The first arrives at 0."""
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate_rps)
    return times
