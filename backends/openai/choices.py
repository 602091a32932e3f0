"""Several choices of one API request (OpenAI's ``n``, a completion's list of prompts): one orchestrator request per
choice, their responses merged into one stream of (choice index, piece).

Choice ``k`` is prompt ``k // n``'s sample ``k % n``. With a ``seed``, sample ``i`` is sent with seed + i, as vLLM's
parallel sampling seeds its children (``vllm/v1/engine/parallel_sampling.py``): the choices differ, and the request
repeats. A prompt's first choice is sent at once, its other choices once the first's first response has come: its
prompt's KV pages are written then and in the orchestrator's prefix cache (docs/design.md, "Prefix cache"), so the
other choices share them copy-free and neither prefill the prompt nor decode its media again (with the prefix cache
off they do both; their replies are the same). vLLM's children share their prompt's blocks the same way. Every
choice is streamed from the orchestrator, also for a whole reply (whose one response would come at its end), and
all of them are counted in flight from the start (``OrchestratorClient.reserved``): a request's choices run, or it
is refused (503) before any does. The orchestrator admits a prompt's choices as one
(``orchestrator.choice_reservations``): the first is sent with ``choices`` n and admitted only where its waiting
queue (``max_waiting_requests``) has room for all n, which holds places for the others; they name the first's
request id in ``choice_of`` and take them, whatever the load by then (a fresh user's break test saw a 503 after the
first choice had streamed).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from typing import AsyncIterator, Protocol

from backends.openai.convert import OrchestratorRequest
from backends.openai.errors import ApiError, unexpected
from client.pieces import ResponsePiece


class Generator(Protocol):
    def generate(self, request: OrchestratorRequest, reserved: bool = False) -> AsyncIterator[ResponsePiece]: ...

    def reserved(self, requests: int) -> contextlib.AbstractContextManager: ...


def _named(exc: Exception, prompt: int, prompts: int) -> Exception:
    """``exc`` with an error about the prompt naming the API's field, ``prompt`` (the orchestrator's ``prompt:`` or
    ``prompt_token_ids:``), and which one where the request has several (``prompt[1]: prompt too long: ...``)."""
    if not isinstance(exc, ApiError):
        return exc
    where = f"prompt[{prompt}]:" if prompts > 1 else "prompt:"
    for name in ("prompt_token_ids:", "prompt:"):
        if exc.message.startswith(name):
            return ApiError(exc.status, where + exc.message[len(name):], exc.param, exc.code)
    if prompts > 1 and exc.param == "prompt":  # "prompt too long: ...", "the prompt (...)"
        return ApiError(exc.status, f"{where} {exc.message}", exc.param, exc.code)
    return exc


def sample_requests(prompt: OrchestratorRequest, n: int) -> list[OrchestratorRequest]:
    """``prompt``'s request once per sample, streamed (a whole reply's first response is its last: module docstring),
    sample ``i``'s ``seed`` (where set) raised by ``i``; only sample 0 asks for the prompt's log probabilities and
    token ids (the others' are the same: the API's bodies copy them), so the others share its cached pages. With
    ``n`` over 1, sample 0 has a request id of its own and asks for ``n`` choices; the others name it in
    ``choice_of``."""
    prompt = dataclasses.replace(prompt, stream=True)
    if n == 1:
        return [prompt]
    first = dataclasses.replace(prompt, request_id=uuid.uuid4().hex, choices=n)
    seed = prompt.sampling.get("seed")
    others = {key: value for key, value in prompt.sampling.items() if key != "prompt_logprobs"}
    return [first] + [dataclasses.replace(prompt, choice_of=first.request_id, return_prompt_ids=False,
                                          sampling=others if seed is None else {**others, "seed": seed + i})
                      for i in range(1, n)]


async def merged(orchestrator: Generator, prompts: list[OrchestratorRequest], n: int
                 ) -> AsyncIterator[tuple[int, ResponsePiece]]:
    """Every choice's responses as (choice index, piece), in the order they come; each choice's last piece has its
    ``finish_reason``. Closing the iterator gives up the choices still running (their requests are cancelled);
    the first error of any choice ends it (the others are given up) and is raised: ApiError, as
    ``OrchestratorClient.generate`` raises them."""
    if len(prompts) == 1 and n == 1:  # one choice: no tasks, no queue (the 32-stream path costs per token)
        try:
            async with contextlib.aclosing(orchestrator.generate(prompts[0])) as pieces:
                async for piece in pieces:
                    yield 0, piece
        except ApiError as exc:
            raise _named(exc, 0, 1) from None
        except asyncio.CancelledError as exc:
            if asyncio.current_task().cancelling():  # the client went away: the handler is cancelled
                raise
            raise unexpected(exc) from None
        return
    samples = [sample_requests(prompt, n) for prompt in prompts]
    queue: asyncio.Queue = asyncio.Queue()
    tasks: list[asyncio.Task] = []

    async def run(index: int) -> None:
        waiting = index % n == 0  # a prompt's first choice: its samples wait for its first response
        try:
            request = samples[index // n][index % n]
            async with contextlib.aclosing(orchestrator.generate(request, reserved=True)) as pieces:
                async for piece in pieces:
                    queue.put_nowait((index, piece))
                    if waiting:  # its prompt's pages are cached now: its other samples share them
                        waiting = False
                        start(range(index + 1, index + n))
        except asyncio.CancelledError as exc:
            if asyncio.current_task().cancelling():  # given up below
                raise
            queue.put_nowait((index, unexpected(exc)))
        except Exception as exc:  # noqa: BLE001 - raised where the stream is read
            queue.put_nowait((index, _named(exc, index // n, len(prompts))))
        else:
            if waiting:  # it ended without a response: its samples go all the same (never stranded)
                start(range(index + 1, index + n))
            queue.put_nowait((index, None))

    def start(indices: range) -> None:
        loop = asyncio.get_running_loop()
        tasks.extend(loop.create_task(run(index)) for index in indices)

    with orchestrator.reserved(len(prompts) * n):
        start(range(0, len(prompts) * n, n))
        try:
            for _ in range(len(prompts) * n):
                while (item := await queue.get())[1] is not None:
                    if isinstance(item[1], Exception):
                        raise item[1]
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
