"""The orchestrator's BLS calls to the stages (only page indices and small JSON travel; no tensors).

Every call is the Python backend's synchronous ``exec()`` made on a worker thread (supported in decoupled
models), not ``async_exec()`` from this model's own event loop. A decoupled call's blocking response
iterator is pumped by the same thread into an asyncio queue, so the orchestrator's event loop never
blocks (invariant 1). Open bug, GPU machine only: under concurrent requests the 2.51 stub of this model
has crashed in a C++ thread with either form of call (bench/results/device-2026-11-29, runs 3 and 4).
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import AsyncIterator, Callable

import numpy as np

from backends import triton_io
from backends.internal_token import internal_token


class _Pumps:
    """The threads reading decoupled BLS streams, so that ``finalize()`` can wait for them: a thread still
    inside a response iterator when the stub exits touches Triton objects that are gone."""

    def __init__(self):
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()

    def start(self, thread: threading.Thread) -> None:
        with self._lock:
            self._threads.add(thread)
        thread.start()

    def done(self, thread: threading.Thread) -> None:
        with self._lock:
            self._threads.discard(thread)

    def busy(self) -> bool:
        with self._lock:
            return bool(self._threads)

    def join(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` seconds for every stream to end; returns how many have not."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return sum(thread.is_alive() for thread in threads)


PUMPS = _Pumps()


class StageError(RuntimeError):
    """A stage answered with an error; ``invalid_input`` when it blames the request (e.g. a bad video)."""

    def __init__(self, message: str, invalid_input: bool = False):
        super().__init__(message)
        self.invalid_input = invalid_input


def _request(model: str, inputs: dict[str, object], outputs: list[str]):
    pb = triton_io.pb()
    tensors = [triton_io.str_tensor("token", [internal_token()])]
    for name, value in inputs.items():
        if isinstance(value, (bytes, str)):
            tensors.append(triton_io.str_tensor(name, [value]))
        else:
            tensors.append(pb.Tensor(name, np.asarray(value)))
    return pb.InferenceRequest(model_name=model, inputs=tensors, requested_output_names=outputs)


async def _stream(model: str, inputs: dict[str, object], outputs: list[str]) -> AsyncIterator:
    """Yield the responses of a decoupled BLS call as they come (errors raise StageError)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def pump():
        try:
            for response in _request(model, inputs, outputs).exec(decoupled=True):
                loop.call_soon_threadsafe(queue.put_nowait, response)
        except Exception as exc:  # the request could not be sent: surface it to the awaiting coroutine
            loop.call_soon_threadsafe(queue.put_nowait, exc)
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, None)
            PUMPS.done(thread)

    thread = threading.Thread(target=pump, name=f"bls-{model}", daemon=True)
    PUMPS.start(thread)
    while (response := await queue.get()) is not None:
        if isinstance(response, Exception):
            raise StageError(f"{model}: {response}")
        if response.has_error():
            message = response.error().message()
            raise StageError(message, invalid_input=message.startswith(("video", "image")))
        yield response


def _output(response, name: str):
    tensor = triton_io.pb().get_output_tensor_by_name(response, name)
    return None if tensor is None else tensor.as_numpy()


async def flashcodec_decode(request_id: str, media: bytes | str, plan: dict,
                            on_group: Callable[[int, list[int]], None]) -> None:
    """Decode one media item by ``plan``; ``on_group(g, pages)`` as each group is ready in the patch
    pages the stage took for it (from then on the caller's to free; ``on_group`` must not raise, or the
    pages of later groups would be lost). Returns when the stage's stream has ended (after that it
    neither takes nor writes pages for this call)."""
    inputs = {"request_id": request_id, "op": "decode", "plan": json.dumps(plan)}
    if isinstance(media, bytes):
        inputs["media"] = np.array([media], dtype=np.object_)
    async for response in _stream("flashcodec", inputs, ["group", "pages"]):
        group = _output(response, "group")
        if group is not None:
            on_group(int(group[0]), [int(p) for p in _output(response, "pages")])


async def flashcodec_abort(request_id: str) -> None:
    async for _ in _stream("flashcodec", {"request_id": request_id, "op": "abort"}, ["group"]):
        pass


async def encode_prefill(plan: dict, model: str = "encode_prefill") -> dict:
    """Run one step plan on ``model`` (a replica of the stage); returns the stage's result JSON."""
    request = _request(model, {"plan": json.dumps(plan)}, ["result"])
    response = await asyncio.to_thread(request.exec)
    if response.has_error():
        raise StageError(response.error().message())
    return json.loads(_output(response, "result")[0])


async def decode_admit(payload: dict, model: str = "decode") -> None:
    async for _ in _stream(model, {"op": "admit", "payload": json.dumps(payload)}, ["seq_ids"]):
        pass


async def decode_abort(seq_id: str, model: str = "decode") -> None:
    """Returns once ``model``'s decode loop has dropped ``seq_id`` (its KV pages may then be reused)."""
    async for _ in _stream(model, {"op": "abort", "payload": json.dumps({"seq_id": seq_id})}, ["seq_ids"]):
        pass


async def decode_stream(on_step: Callable[[list[str], list[int], list[str]], None],
                        attached: asyncio.Event, model: str = "decode") -> None:
    """``model``'s long-lived stream: ``on_step(seq_ids, token_ids, finish_reasons)`` once per decode step."""
    async for response in _stream(model, {"op": "stream"}, ["seq_ids", "token_ids", "finish_reasons"]):
        attached.set()
        seq_ids = _output(response, "seq_ids")
        if seq_ids is None or seq_ids.size == 0:
            continue
        on_step([s.decode() for s in seq_ids], [int(t) for t in _output(response, "token_ids")],
                [r.decode() for r in _output(response, "finish_reasons")])
