"""The orchestrator's side of one flashcodec call (``orchestrator.engine``): the groups flashcodec reports for one
media item of a request go to the engine's scheduler as they come (their patch pages with them); a bad report or a
call that ends before every sampled group was found fails the request (its pages are returned by its release)."""
from __future__ import annotations

from typing import TYPE_CHECKING, AsyncIterator

from backends.ipc.link import StageError
from backends.ipc.protocol import INVALID_INPUT, SERVER_FAULT, GroupReady, StageFailure
from orchestrator.engine_io import SHUTTING_DOWN, Tracked, failure_of

if TYPE_CHECKING:
    from orchestrator.engine import Engine


async def run_media(engine: "Engine", tracked: Tracked, item: int, replies: AsyncIterator[GroupReady],
                    first: int = 0) -> None:
    """Hands the groups that flashcodec reports for ``item`` to the scheduler; ``first``: the group the call's
    plan starts at (those before are cached)."""
    req_id, reported, bad = tracked.request.new.req_id, first, []
    try:
        async for ready in replies:
            # The pages are ours from here on: a bad report frees them and the stream is read to its end.
            index = ready.index + first
            try:
                report = engine.scheduler.group_ready(req_id, item, index, list(ready.pages))
            except (KeyError, ValueError) as exc:
                engine.patch_pages.free(ready.pages)
                bad.append(str(exc))
                continue
            reported += report == "cached"  # in the prefix cache since it was admitted: not encoded
            if report == "taken":
                tracked.request.timeline.mark("group_ready", item=item, index=index, pages=len(ready.pages))
                reported += 1
                tracked.patch_pages_held += len(ready.pages)
                tracked.patch_pages_peak = max(tracked.patch_pages_peak, tracked.patch_pages_held)
                engine.wake.set()
        if bad:
            raise StageError(StageFailure(SERVER_FAULT, f"flashcodec: {bad[0]}"))
        if reported < tracked.request.groups_per_item[item] and not tracked.releasing:
            if engine.stopping or engine.server_stopping():  # flashcodec ends its calls when the server stops
                raise StageError(StageFailure(SERVER_FAULT, SHUTTING_DOWN))
            raise StageError(StageFailure(
                INVALID_INPUT, f"{_name(tracked, item)}: decoding ended before all sampled frames were found"))
    except Exception as exc:
        if (live := engine.live(req_id)) is not None:
            engine.fail(live, _named(failure_of(exc, f"media task failed for {req_id}"), tracked, item))


def _name(tracked: Tracked, item: int) -> str:
    """What errors call the request's media ``item`` (``EngineRequest.media_names``, else its kind)."""
    names = tracked.request.media_names
    return names[item] if item < len(names) else tracked.request.new.media[item].kind


def _named(failure: StageFailure, tracked: Tracked, item: int) -> StageFailure:
    """flashcodec's error about the item's content ("image: truncated or corrupt ..."), which knows only its kind,
    naming the item as the request's other errors do (``image_url (item 2 of 3): truncated or corrupt ...``)."""
    kind = tracked.request.new.media[item].kind
    if failure.kind != INVALID_INPUT or not failure.message.startswith(f"{kind}: "):
        return failure
    return StageFailure(INVALID_INPUT, f"{_name(tracked, item)}: {failure.message.removeprefix(f'{kind}: ')}")
