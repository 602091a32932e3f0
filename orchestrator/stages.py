"""The orchestrator's calls to the stages (only page indices and small JSON travel; no tensors).

encode_prefill: one plain BLS call per scheduler step, the Python backend's synchronous ``exec()`` made on a
worker thread, so the event loop never blocks (invariant 1). decode and flashcodec: calls and their streamed
replies over the stage link (backends/ipc/link.py), not decoupled BLS, whose calls wedge the 2.51 stub
under load (the link module says how).
"""
from __future__ import annotations

import asyncio
import json
from typing import Callable

from backends.triton import triton_io
from backends.triton.internal_token import internal_token
from backends.ipc.link import LinkClient, LinkError


class StageError(RuntimeError):
    """A stage answered with an error; ``invalid_input`` when it blames the request (e.g. a bad video)."""

    def __init__(self, message: str, invalid_input: bool = False):
        super().__init__(message)
        self.invalid_input = invalid_input


class Links:
    """The stage links of this orchestrator, by stage model name (``decode``, ``decode_1``, ``flashcodec``)."""

    def __init__(self):
        self._links: dict[str, LinkClient] = {}

    def __getitem__(self, name: str) -> LinkClient:
        if name not in self._links:  # on the event loop only
            self._links[name] = LinkClient(name)
        return self._links[name]

    def busy(self) -> bool:
        """Whether any call is still waiting for its end."""
        return any(link.busy() for link in self._links.values())

    def close(self) -> None:
        for link in self._links.values():
            link.close()


LINKS = Links()


async def _stream(model: str, op: str, body=None):
    """Yield the replies of one stage-link call (errors raise StageError)."""
    try:
        async for payload in LINKS[model].call(op, body):
            yield payload
    except LinkError as exc:
        raise StageError(str(exc), exc.invalid_input) from None


def _request(model: str, inputs: dict[str, str], outputs: list[str]):
    tensors = [triton_io.str_tensor(name, [value]) for name, value in {"token": internal_token(), **inputs}.items()]
    return triton_io.pb().InferenceRequest(model_name=model, inputs=tensors, requested_output_names=outputs)


def _output(response, name: str):
    tensor = triton_io.pb().get_output_tensor_by_name(response, name)
    return None if tensor is None else tensor.as_numpy()


async def flashcodec_decode(request_id: str, media: bytes | str, plan: dict,
                            on_group: Callable[[int, list[int]], None]) -> None:
    """Decode one media item by ``plan`` (``{"media_plan", "path"}``; ``media`` is the file's bytes, or b""
    when the path is set); ``on_group(g, pages)`` as each group is ready in the patch pages the stage took
    for it (from then on the caller's to free; ``on_group`` must not raise, or the pages of later groups
    would be lost). Returns when the stage's call has ended (after that it neither takes nor writes pages
    for this call)."""
    body = {"request_id": request_id, "media": media or None, "plan": plan}
    async for group, pages in _stream("flashcodec", "decode", body):
        on_group(group, pages)


async def flashcodec_abort(request_id: str) -> None:
    async for _ in _stream("flashcodec", "abort", request_id):
        pass


async def encode_prefill(plan: dict, model: str = "encode_prefill") -> dict:
    """Run one step plan on ``model`` (a replica of the stage); returns the stage's result JSON."""
    request = _request(model, {"plan": json.dumps(plan)}, ["result"])
    response = await asyncio.to_thread(request.exec)
    if response.has_error():
        raise StageError(response.error().message())
    return json.loads(_output(response, "result")[0])


async def decode_admit(payload: dict, model: str = "decode") -> None:
    async for _ in _stream(model, "admit", payload):
        pass


async def decode_abort(seq_id: str, model: str = "decode") -> None:
    """Returns once ``model``'s decode loop has dropped ``seq_id`` (its KV pages may then be reused)."""
    async for _ in _stream(model, "abort", seq_id):
        pass


async def decode_stream(on_step: Callable[[list[str], list[int], list[str]], None],
                        attached: asyncio.Event, model: str = "decode") -> None:
    """``model``'s long-lived stream: ``on_step(seq_ids, token_ids, finish_reasons)`` once per decode step."""
    async for step in _stream(model, "stream"):
        attached.set()
        if step is not None:
            on_step(*step)
