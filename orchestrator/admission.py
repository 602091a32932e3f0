"""The admission rule of the budget scheduler (``orchestrator.scheduler``; docs/design.md, "Scheduling"): which
waiting sequences get their KV pages now. Pure arithmetic on page counts."""
from __future__ import annotations


def backfill(needs: list[tuple[int, bool]], free: int, total: int) -> list[int]:
    """Indices of the sequences granted pages now, in the order granted.

    Sequences are taken in arrival order up to the first that does not fit (the head). Later ones that fit may go
    ahead of it (backfill, as in EASY backfilling of batch schedulers) while the pages held by sequences that
    arrived after the head stay within what the pool leaves over once the head has its pages (``total`` - head's
    need). So the head is admitted at the latest when the sequences admitted before it became the head have ended,
    whatever arrives after: small requests do not wait behind a large one, and cannot starve it.

    Args:
        needs: per sequence in arrival order, (pages: what it takes of ``free`` if waiting, what it holds if not;
            admitted: it holds its pages, or is never to be granted any).
        free: pages that may be granted now.
        total: pages that sequences may hold at once.
    """
    granted, head = [], None
    for i, (need, admitted) in enumerate(needs):
        if admitted:
            continue
        if need > free:
            head = i
            break
        granted.append(i)
        free -= need
    if head is None:
        return granted
    later = range(head + 1, len(needs))
    leftover = total - needs[head][0] - sum(needs[i][0] for i in later if needs[i][1])
    for i in later:
        need, admitted = needs[i]
        if not admitted and need <= min(leftover, free):
            granted.append(i)
            free -= need
            leftover -= need
    return granted
