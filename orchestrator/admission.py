"""The admission rule of the budget scheduler (``orchestrator.scheduler``; docs/design.md, "Scheduling"): which
waiting sequences get their first KV pages now. Pure arithmetic on page counts."""
from __future__ import annotations

from typing import NamedTuple

from orchestrator.kv_growth import Need, SafeState


class Candidate(NamedTuple):
    """A sequence in arrival order (pages): ``take``, what it takes of the free pages if admitted now; ``worst``, its
    prompt + ``max_tokens`` (what it may come to hold); ``need``, its ``Need`` once admitted, None where it is
    admitted already or never to be (then ``take`` is 0)."""

    take: int
    worst: int
    need: Need | None


def backfill(candidates: list[Candidate], total: int, state: SafeState) -> list[int]:
    """Indices of the sequences admitted now, in the order admitted (``state`` counts them in).

    Sequences are taken in arrival order up to the first that cannot be admitted safely (``SafeState.admits``: the
    head). Later ones may go ahead of it (backfill, as in EASY backfilling of batch schedulers) while the worst
    cases of sequences that arrived after the head stay within what the pool leaves over beside the head's worst
    case (``total`` - head's ``worst``). So the head is admitted at the latest when the sequences admitted before
    it became the head have ended, whatever arrives after: small requests do not wait behind a large one, and cannot
    starve it.

    Args:
        candidates: every sequence the scheduler holds, in arrival order.
        total: pages that sequences may hold at once.
        state: the admitted sequences' worst cases and the free pages.
    """
    admitted, head = [], None
    for i, (take, _, need) in enumerate(candidates):
        if need is None:
            continue
        if not state.admits(take, need):
            head = i
            break
        state.admit(take, need)
        admitted.append(i)
    if head is None:
        return admitted
    later = range(head + 1, len(candidates))
    leftover = total - candidates[head].worst - sum(candidates[i].worst for i in later if candidates[i].need is None)
    for i in later:
        take, worst, need = candidates[i]
        if need is not None and worst <= leftover and state.admits(take, need):
            state.admit(take, need)
            admitted.append(i)
            leftover -= worst
    return admitted
