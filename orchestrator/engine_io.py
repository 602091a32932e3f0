"""What goes into and comes out of a replica's engine (``orchestrator.engine``): the request it runs, the outputs
and states of a request, and the record of a request that has left it."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from backends.ipc.protocol import MediaDecode, NewRequest, StageFailure
from orchestrator.sequence import Group
from orchestrator.timeline import NO_TIMELINE, Timeline

SHUTTING_DOWN = "the server is shutting down"


class RequestState(enum.Enum):
    WAITING = "waiting"
    ENCODING = "encoding"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass(frozen=True)
class Output:
    """What a request's output queue receives: a ``token`` with its ``finish_reason`` (``""``: more follow), or
    a ``failure`` (nothing follows it)."""

    token: int = -1
    finish_reason: str = ""
    failure: StageFailure | None = None


@dataclass
class RequestCounts:
    """What the engine learns of a request as it runs: ``cached_tokens``, its prompt tokens found in the prefix
    cache (set when its first token arrives)."""

    cached_tokens: int = 0


@dataclass(frozen=True)
class EngineRequest:
    """A request ready to run: ``new`` (prompt, media grids, sampling), its media ``groups`` in prompt order,
    one ``MediaDecode`` call per media item with ``groups_per_item`` groups, and its prompt's ``block_hashes``
    (``orchestrator.prefix_cache``; empty: no prefix caching)."""

    new: NewRequest
    groups: tuple[Group, ...]
    media: tuple[MediaDecode, ...] = ()
    groups_per_item: tuple[int, ...] = ()
    timeline: Timeline = NO_TIMELINE  # where its time goes, when the client asked (orchestrator.timeline)
    block_hashes: tuple[bytes, ...] = ()
    counts: RequestCounts = field(default_factory=RequestCounts)

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
