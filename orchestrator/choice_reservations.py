"""A request's choices admitted as one (OpenAI's ``n``): places in the waiting queue held for a request's later
choices while its first one runs.

The OpenAI API sends a prompt's first choice alone and its other choices once the first has answered, so that they
share its prompt's KV pages through the prefix cache (``backends.openai.choices``). Under a load that keeps
``max_waiting_requests`` requests waiting, the later choices found the queue full after the first had streamed (a
fresh user's break test: a request refused with 503 after its first choice had run). vLLM admits a request's
children with their parent. Here the first choice carries ``choices`` (how many requests the choices make) and is
admitted only where the waiting queue has room for all of them, the places already held for other requests' choices
counted as waiting; each later choice names the first's request id in ``choice_of`` and takes a held place, whatever
the load. A single request does not count held places, so a client holding places it never takes refuses no plain
request (a fresh user's break test). Held places that no choice takes are given back ``GRACE_S`` seconds after the
first choice ends (the OpenAI API sends its later choices at the first's first response).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from orchestrator.inputs import one_name
from orchestrator.sampling_params import InvalidInput

MAX_CHOICES = 128  # the OpenAI API's limit on n (and on a completion's prompts times n)
GRACE_S = 5.0  # how long held places outlive the request that holds them


@dataclass
class _Held:
    places: int
    expires: float | None = None  # time.monotonic() seconds; None while its first choice runs


class ChoiceReservations:
    """Held places by the first choice's request id, on the orchestrator's event loop; ``clock``: seconds
    (``time.monotonic``)."""

    def __init__(self, grace_s: float = GRACE_S, clock: Callable[[], float] = time.monotonic):
        self.grace_s, self.clock = grace_s, clock
        self._held: dict[str, _Held] = {}

    def held(self) -> int:
        """Places held now, in all (those past their grace given back first)."""
        self._give_back_expired()
        return sum(v.places for v in self._held.values())

    def _give_back_expired(self) -> None:
        now = self.clock()
        for request_id in [k for k, v in self._held.items() if v.expires is not None and v.expires <= now]:
            del self._held[request_id]

    def hold(self, request_id: str, places: int) -> None:
        """Hold ``places`` (at least 1) for the later choices of the request ``request_id``, just admitted.
        Raises InvalidInput when a request of that id holds places already (its later choices could not be told
        from this one's)."""
        self._give_back_expired()
        if request_id in self._held:
            raise InvalidInput(f"choices: a request with id {request_id!r} holds places for its choices already: "
                               "give each request its own id")
        self._held[request_id] = _Held(places)

    def take(self, request_id: str) -> bool:
        """Take one of the places held for ``request_id``'s choices; False when none is left (never held, all
        taken, or given back)."""
        self._give_back_expired()
        held = self._held.get(request_id)
        if held is None:
            return False
        held.places -= 1
        if not held.places:
            del self._held[request_id]
        return True

    def ended(self, request_id: str) -> None:
        """The request holding places has ended: what no choice has taken is given back after the grace."""
        held = self._held.get(request_id)
        if held is not None and held.expires is None:
            held.expires = self.clock() + self.grace_s


def choices_input(values: list[int] | None) -> int:
    """The ``choices`` input's value (1 when absent). Raises InvalidInput for more than one value or one outside
    [1, ``MAX_CHOICES``]."""
    if values is None or not values:
        return 1
    if len(values) > 1:
        raise InvalidInput(f"choices: expected one value, got {len(values)}")
    if not 1 <= values[0] <= MAX_CHOICES:
        raise InvalidInput(f"choices: must be in [1, {MAX_CHOICES}], got {values[0]}")
    return values[0]


def choice_of_input(values: list[bytes]) -> str:
    """The ``choice_of`` input's request id ("" when absent). Raises InvalidInput as ``inputs.one_name`` does."""
    return one_name(values, "choice_of", "request id")
