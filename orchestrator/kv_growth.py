"""KV pages granted as a reply grows, without preemption: the safety rule of the budget scheduler
(``orchestrator.scheduler``; docs/design.md, "Scheduling"). Pure arithmetic on page counts.

A sequence gets the pages of its prompt and of its next few tokens when it is admitted, and more as decode writes
them (``Scheduler.grow``), instead of prompt + ``max_tokens`` up front: a chat that may run to 4,096 tokens but
ends after 200 holds 200 tokens' pages, so many more run at once (vLLM and SGLang grant pages lazily too; they take
pages back by preempting a sequence and recomputing it later). Here nothing is taken back: a grant, and an
admission, is made only where the pool stays *safe*, the banker's algorithm (Dijkstra, 1965) for one resource:
there is an order in which every sequence can be granted the rest of its worst case (``remaining``: its prompt +
``max_tokens`` pages less those it holds) and then finish, each finishing return its pages (``releases``) to the
next. In a safe state the sequence first in that order can always be granted (``plan``), so decode never deadlocks;
a sequence refused a page waits in decode (skipped by its steps) until one ends. Pages a removed sequence still holds
(the step in flight writes them) count as its returns until they are free (``KVGrants``).

``releases`` may undercount (``KVGrants`` counts none of a sequence's full prompt pages, which the prefix cache may
share with others: a shared page is not returned when one of them ends): a state safe with fewer pages returned is
safe. With one resource, finishing the smallest ``remaining`` first is as good as any order
(a finish never lowers the free count), so checking that order is enough.
"""
from __future__ import annotations

import bisect
import itertools
import math
from typing import Hashable, Iterable, Mapping, NamedTuple


class Need(NamedTuple):
    """One admitted sequence's worst case (pages): ``remaining`` it may still be granted, ``releases`` it is sure
    to return on finishing beyond those."""

    remaining: int
    releases: int


def safe(free: int, needs: Iterable[Need]) -> bool:
    """Whether every sequence of ``needs`` can finish with ``free`` pages (pages): the banker's check, smallest
    ``remaining`` first."""
    for remaining, releases in sorted(needs):
        if remaining > free:
            return False
        free += releases
    return True


def plan(free: int, needs: Mapping[Hashable, Need], wants: Mapping[Hashable, int]) -> dict[Hashable, int]:
    """Pages to grant now (key -> pages, only those granted: at least 1, at most ``wants[key]``, itself at most its
    ``remaining``), every grant keeping the pool safe, in the safe order (the sequence nearest its worst case first);
    never more than ``free`` in all, whatever the state.

    Granting ``k`` pages to the sequence at place ``p`` of the safe order leaves ``p`` and the places after it as
    they were (its ``remaining`` falls by ``k`` and what it returns rises by ``k``) and takes ``k`` from the slack of
    each place before it, the slack of place ``q`` being ``free`` + the returns before ``q`` - its ``remaining``.
    So one pass over the order decides every grant: the least slack before a place (``free`` itself counting as the
    first) is what may be granted there.

    Args:
        free: pages that may be granted now (pages).
        needs: every admitted sequence's ``Need``, those in ``wants`` among them; in a safe state.
        wants: pages each asking sequence would take now (>= 1).

    Raises:
        ValueError: a want above its sequence's ``remaining``, or for a sequence not in ``needs``.
    """
    for key, want in wants.items():
        if key not in needs or not 0 < want <= needs[key].remaining:
            raise ValueError(f"{key}: wants {want} pages, may still be granted "
                             f"{needs[key].remaining if key in needs else 'none (not admitted)'}")
    if free >= sum(need.remaining for need in needs.values()):  # every worst case fits at once: nothing to order
        return dict(wants)
    granted: dict[Hashable, int] = {}
    slack_before = free  # the least slack of the places passed (the free pages first), less the grants made after
    returned = 0
    for key, (remaining, releases) in sorted(needs.items(), key=lambda item: item[1]):
        if (grant := min(wants.get(key, 0), slack_before)) > 0:
            granted[key] = grant
            slack_before -= grant
        slack_before = min(slack_before, free + returned - remaining)
        returned += releases
    return granted


class SafeState:
    """The admitted sequences' ``Need``s, for admitting waiting sequences one after another: each is checked at its
    own place in the safe order (its ``remaining`` among theirs), exactly the banker's check of the state with it
    (O(log n) a check, O(n) an admission), so a sequence that needs nothing beyond what it takes goes ahead of a long
    reply whose worst case the pool holds only with the short one's pages back.

    Args:
        free: pages that may be granted now (pages).
        needs: every admitted sequence's ``Need``, in a safe state.
    """

    def __init__(self, free: int, needs: Iterable[Need]):
        self.free = free
        self._needs = sorted(needs)
        self._index()

    def _index(self) -> None:
        """Per place ``k`` of the order: the returns before it, and the least slack (``free`` + returns before a
        place - its ``remaining``) of the places before it and of those from it on."""
        self._remaining = [remaining for remaining, _ in self._needs]
        self._returns = list(itertools.accumulate((releases for _, releases in self._needs), initial=0))
        slack = [self.free + self._returns[k] - remaining for k, remaining in enumerate(self._remaining)]
        self._least_before = list(itertools.accumulate(slack, min, initial=math.inf))
        self._least_from = list(itertools.accumulate(reversed(slack), min, initial=math.inf))[::-1]

    def admits(self, take: int, need: Need) -> bool:
        """Whether a sequence taking ``take`` pages now, its ``need`` after, keeps the pool safe: the places before
        its own lose ``take`` of their slack, its own has the returns before it, the places after it gain its
        releases less ``take``."""
        k = bisect.bisect_right(self._remaining, need.remaining)
        return (take <= self.free and take <= self._least_before[k]
                and need.remaining <= self.free - take + self._returns[k]
                and take - need.releases <= self._least_from[k])

    def admit(self, take: int, need: Need) -> None:
        """Count it in (after ``admits``)."""
        self.free -= take
        bisect.insort(self._needs, need)
        self._index()
