"""What goes into and comes out of a replica's engine (``orchestrator.engine``): the request it runs, the outputs
and states of a request, the engine's state of a request it runs, and the record of a request that has left it."""
from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass, field

from backends.ipc.link import StageError
from backends.ipc.protocol import (INVALID_INPUT, NO_MATCH, SERVER_FAULT, MediaDecode, NewRequest, PromptLogprobs,
                                   StageFailure, TokenLogprobs)
from orchestrator.sequence import Group
from orchestrator.timeline import NO_TIMELINE, Timeline

log = logging.getLogger("orchestrator.engine")

SHUTTING_DOWN = "the server is shutting down"


def shutting_down(why: str = "") -> StageError:
    """The error of a request refused or ended because the server is stopping (``why``, if said)."""
    return StageError(StageFailure(SERVER_FAULT, f"{SHUTTING_DOWN} ({why})" if why else SHUTTING_DOWN))


class RequestState(enum.Enum):
    WAITING = "waiting"
    ENCODING = "encoding"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass(frozen=True)
class Output:
    """What a request's output queue receives: a ``token`` with its ``finish_reason`` (``""``: more follow) and,
    where the request asked, its ``logprobs`` (and with its first token, its ``prompt_logprobs``); or a ``failure``
    (nothing follows it)."""

    token: int = -1
    finish_reason: str = ""
    failure: StageFailure | None = None
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None

    @classmethod
    def last(cls, token: int, finish_reason: str, logprobs: TokenLogprobs | None = None,
             prompt_logprobs: PromptLogprobs | None = None) -> "Output":
        """A stage's last token for a request; ``NO_MATCH`` (its structured output's grammar allows no token after
        the output so far) is the client's failure: INVALID_ARG, naming ``structured_outputs``."""
        if finish_reason == NO_MATCH:
            return cls(failure=StageFailure(INVALID_INPUT, "sampling_parameters: structured_outputs: no output can "
                                                           "match it (its grammar allows no token after the output "
                                                           "so far)"))
        return cls(token, finish_reason, logprobs=logprobs, prompt_logprobs=prompt_logprobs)


@dataclass
class RequestCounts:
    """What the engine learns of a request as it runs: ``cached_tokens``, its prompt tokens found in the prefix
    cache (set when its first token arrives)."""

    cached_tokens: int = 0


@dataclass(frozen=True)
class EngineRequest:
    """A request ready to run: ``new`` (prompt, media grids, sampling), its media ``groups`` in prompt order,
    one ``MediaDecode`` call per media item with ``groups_per_item`` groups, what errors call each item
    (``media_names``: ``MediaInput.input_name``), and its prompt's ``block_hashes`` (``orchestrator.prefix_cache``;
    empty: no prefix caching)."""

    new: NewRequest
    groups: tuple[Group, ...]
    media: tuple[MediaDecode, ...] = ()
    groups_per_item: tuple[int, ...] = ()
    timeline: Timeline = NO_TIMELINE  # where its time goes, when the client asked (orchestrator.timeline)
    block_hashes: tuple[bytes, ...] = ()
    counts: RequestCounts = field(default_factory=RequestCounts)
    media_names: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        """Its modality for SLO targets: "video" with a video, else "image" with an image, else "text"."""
        kinds = {m.kind for m in self.new.media}
        return "video" if "video" in kinds else "image" if kinds else "text"


@dataclass(frozen=True)
class Released:
    """What ``on_release`` gets for each request leaving the engine: its id, the most patch pages it held at once,
    whether it had media, and when (``time.monotonic()`` seconds; 0.0: not reached) it was added, first in a step's
    plan, and had its first and its last token."""

    req_id: str
    patch_pages_peak: int
    had_media: bool
    admitted: float
    scheduled: float
    first_token: float
    last_token: float


@dataclass(eq=False)
class Tracked:
    """The engine's state of a request it runs (``orchestrator.engine``): when it reached each point, its output
    queue and media calls, the patch pages it holds, and where it stands with decode and its release."""

    request: EngineRequest
    admitted: float = field(default_factory=time.monotonic)
    scheduled: float = 0.0  # the first step with work for it was launched (time.monotonic() seconds)
    first_token: float = 0.0
    last_token: float = 0.0
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    media_tasks: list[asyncio.Task] = field(default_factory=list)
    patch_pages_held: int = 0  # reported by flashcodec and not yet encoded (pages)
    patch_pages_peak: int = 0  # the most it held at once (pages)
    mrope_delta: int = 0
    in_decode: bool = False
    decode_done: bool = False  # decode no longer holds it (last row sent, failed, or its stream ended)
    ended: bool = False  # its last output (finish reason or failure) is queued
    releasing: bool = False

    @property
    def decoding(self) -> bool:
        """Decode holds it: handed to decode, with no last row, failure or end of decode's stream yet."""
        return self.in_decode and not self.decode_done

    @property
    def joining(self) -> bool:
        """Decode holds it and has sent no token of it yet (``orchestrator.decode_pace``, "Holding a burst's joins")."""
        return self.decoding and self.last_token == self.first_token

    def end(self, output: Output) -> bool:
        """Queue the request's last ``output`` (a finish reason or a failure); False when it had one already."""
        if self.ended:
            return False
        self.ended = True
        self.request.timeline.mark("last_token" if output.failure is None else "failed")
        self.outputs.put_nowait(output)
        return True


def failure_of(exc: Exception, what: str) -> StageFailure:
    """A stage's own failure, or an internal error (logged) that must fail the request, not hang it."""
    if isinstance(exc, StageError):
        return exc.failure
    log.exception("orchestrator: %s", what)
    return StageFailure(SERVER_FAULT, f"internal error: {type(exc).__name__}: {exc}")
