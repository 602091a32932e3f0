"""The stages as the engine sees them: two small interfaces, and their implementation over the stage link.

``ReplicaStages`` is one replica's encode_prefill and decode stages (``backends.triton.replicas``);
``MediaStage`` is flashcodec, shared by every replica. The engine (``orchestrator.engine``) is written against
these interfaces only, so its tests drive it with in-process fakes; the server injects ``LinkStages`` /
``LinkMedia``, which send the messages of ``backends.ipc.protocol`` over ``backends.ipc.link``. Every method
raises ``backends.ipc.link.StageError`` when the stage fails the call or has gone.

A method that is a plain ``def`` returning an async iterator queues its call for sending when it is called
(not when iterated), so calls made in order reach a stage in order: an abort never overtakes the admit or
decode it stops.
"""
from __future__ import annotations

from typing import AsyncIterator, Protocol

from backends.ipc import run_dir
from backends.ipc.link import LinkClient, StageError
from backends.ipc.protocol import (SERVER_FAULT, DecodeAbort, DecodeAdmit, DecodeAttach, DecodeGrow, DecodePace,
                                   DecodeStep, GroupReady, MediaAbort, MediaDecode, StageFailure, StepPlan, StepResult)
from backends.triton.replicas import replica_name


class ReplicaStages(Protocol):
    async def step(self, plan: StepPlan) -> StepResult:
        """Run one scheduler step on encode_prefill."""

    def decode_attach(self) -> AsyncIterator[DecodeStep | None]:
        """The decode stage's step stream: ``None`` once attached, then one ``DecodeStep`` per step; it ends when the
        server stops (or, unexpectedly, when the stage's loop has died)."""

    def decode_admit(self, admit: DecodeAdmit) -> AsyncIterator[None]:
        """Hand a prefilled sequence to decode (queued now; iterate to learn that it arrived)."""

    async def decode_abort(self, seq_id: str) -> None:
        """Returns once decode no longer touches ``seq_id``'s KV pages."""

    def decode_pace(self, interval_ms: float, for_ms: float) -> AsyncIterator[None]:
        """Space decode's step launches (``DecodePace``; queued now, in order with the admits and aborts)."""

    def decode_grow(self, grow: DecodeGrow) -> AsyncIterator[None]:
        """More KV pages for sequences in decode (queued now, in order with the admits and aborts)."""


class MediaStage(Protocol):
    def decode(self, request: MediaDecode) -> AsyncIterator[GroupReady]:
        """Decode one media item (queued now): a ``GroupReady`` per group; once it has ended, flashcodec neither
        takes nor writes pages for it."""

    async def abort(self, req_id: str) -> None:
        """The request's decodes end after their current group."""


class Links:
    """This orchestrator's stage links, by stage model name (``decode``, ``decode_r1``, ``flashcodec``, ...)."""

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


class LinkStages:
    """Replica ``index``'s stages over ``links``."""

    def __init__(self, links: Links, index: int):
        self._prefill = links[replica_name("encode_prefill", index)]
        self._decode = links[replica_name("decode", index)]

    async def step(self, plan: StepPlan) -> StepResult:
        (result,) = await self._prefill.request(plan)
        return result

    def decode_attach(self) -> AsyncIterator[DecodeStep | None]:
        return self._decode.call(DecodeAttach())

    def decode_admit(self, admit: DecodeAdmit) -> AsyncIterator[None]:
        return self._decode.call(admit)

    async def decode_abort(self, seq_id: str) -> None:
        await self._decode.request(DecodeAbort(seq_id))

    def decode_pace(self, interval_ms: float, for_ms: float) -> AsyncIterator[None]:
        return self._decode.call(DecodePace(interval_ms, for_ms))

    def decode_grow(self, grow: DecodeGrow) -> AsyncIterator[None]:
        return self._decode.call(grow)


class LinkMedia:
    """flashcodec over ``links``."""

    def __init__(self, links: Links):
        self._link = links["flashcodec"]

    def decode(self, request: MediaDecode) -> AsyncIterator[GroupReady]:
        return self._link.call(request)

    async def abort(self, req_id: str) -> None:
        await self._link.request(MediaAbort(req_id))


PUBLISH_WAIT_S = 120.0  # the longest the orchestrator waits for a stage to publish its pool


async def published(pool: str, missing: str) -> dict:
    """``run_dir.describe(pool)`` (the stage's pool: its shape, dtype), waited for on the loop for up to
    :data:`PUBLISH_WAIT_S` (``run_dir.appeared``: the orchestrator's close cancels it at once). Raises StageError
    when the pool is never published: ``missing`` (which model, what to do: docs/deployment.md, "Model control") and
    what was awaited (a stage that was not loaded with the orchestrator: a fresh user's test; the error quoted the
    pool's file alone)."""
    if not await run_dir.appeared(run_dir.meta_path(pool), PUBLISH_WAIT_S):
        raise StageError(StageFailure(SERVER_FAULT, f"{missing}: load every model of the repository (shared pool "
                                      f"{pool!r} was not published within {PUBLISH_WAIT_S:g} s)"))
    return run_dir.describe(pool, timeout_s=0.0)
