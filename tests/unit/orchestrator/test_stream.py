"""A request's token stream in the orchestrator (``Orchestrator.generate``): tokens that queued up while the
request's handler was busy leave as one item (one client response), with the same ids and text as one by one;
stop strings and max_tokens still end the stream at the right token; an error comes after the tokens before it."""
import asyncio

import pytest

from backends.runtime.tokenizer import load_tokenizer
from orchestrator import stages
from orchestrator.inputs import ParsedRequest
from orchestrator.sampling_params import RequestParams
from orchestrator.service import Active, Event, Orchestrator

TOKENIZER = load_tokenizer(None)
WORDS = TOKENIZER.encode(" one two three four five six seven eight")


def orchestrator() -> Orchestrator:
    """An orchestrator with a tokenizer and no stages: enough for ``generate`` of a request already in decode
    (its ``release`` finds the request untracked and returns)."""
    o = Orchestrator.__new__(Orchestrator)
    o.tokenizer, o.eos_ids, o.active = TOKENIZER, [TOKENIZER.eos_token_id], {}
    return o


def stream(events: list[Event], **params) -> tuple[list[tuple[str, list[int], str | None]], Exception | None]:
    """Every item ``generate`` yields for a request whose ``events`` are all queued before it starts, and the
    exception it ended with (or None)."""

    async def run():
        parsed = ParsedRequest("q", (), RequestParams(**params), True, True, True)
        active = Active("r", parsed, prompt=None, replica=None, in_decode=True)
        for event in events:
            active.events.put_nowait(event)
        items = []
        try:
            async for item in orchestrator().generate(active, lambda: False):
                items.append(item)
        except Exception as exc:  # noqa: BLE001 - returned for the test to check
            return items, exc
        return items, None

    return asyncio.run(run())


def tokens(ids, last_reason="length"):
    return [Event("token", token=t, reason=last_reason if i == len(ids) - 1 else "") for i, t in enumerate(ids)]


def test_queued_tokens_leave_as_one_item_with_the_same_ids_and_text():
    items, error = stream(tokens(WORDS), max_tokens=100)
    assert error is None and len(items) == 1
    text, ids, reason = items[0]
    assert ids == WORDS and reason == "length" and text == TOKENIZER.decode(WORDS)


def test_max_tokens_and_stop_strings_end_inside_a_batch_of_queued_tokens():
    items, _ = stream(tokens(WORDS, last_reason=""), max_tokens=3)
    assert [(ids, reason) for _, ids, reason in items] == [(WORDS[:3], "length")]
    items, _ = stream(tokens(WORDS, last_reason=""), max_tokens=100, stop=["four"])
    text, ids, reason = items[-1]
    assert reason == "stop" and "four" not in text and text.strip() == "one two three"


def test_an_error_comes_after_the_tokens_before_it():
    items, error = stream([*tokens(WORDS[:2], last_reason=""), Event("error", message="decode: the step failed")],
                          max_tokens=100)
    assert [ids for _, ids, _ in items] == [WORDS[:2]] and items[0][2] is None
    assert isinstance(error, stages.StageError) and "the step failed" in str(error)
