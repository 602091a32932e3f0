"""What one encode+prefill step holds: pure functions over the budget scheduler's sequences (``orchestrator.scheduler``;
docs/design.md, "Scheduling").

A normal step fills the encode budget with whole ready groups and then the prefill budget with prompt chunks whose
embeddings are ready, sequences in arrival order, each first capped at ``max_share`` of a budget (``fill_encode``,
``fill_prefill``). A short step (``short_prefills``) holds only short prompts that have not started: a question about
a clip whose KV is cached, or a text request, arriving while a long prompt is encoded and prefilled, then waits for
one small step instead of one that also carries the long prompt's encode and chunk (on an H200, a 50-token prefill
alone took 23-30 ms in the worker, and 90-110 ms in a step beside a 20-s clip's work). The last chunk of a long
prompt is not one: it goes into the next normal step (in 16 one-image requests at once, giving the images' last
254-token chunks short steps of their own made 16 steps of 0.5k and 2k tokens where 10 full ones would do). A prompt's
text stub before media still being decoded waits for it (``Sequence.prefill_end``).
"""
from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable

from backends.ipc.protocol import EncodeWork, PrefillWork
from orchestrator.sequence import Group, Sequence


def fill_encode(seqs: Iterable[Sequence], budget: int, max_share: float) -> list[tuple[Sequence, Group]]:
    """Whole ready groups (those with patch pages) up to ``budget`` patches, prompt order within a sequence,
    sequences in the given (arrival) order, each first capped at ``max_share`` of the budget (a sequence's first
    group of the step exempt: groups are not split). A group larger than ``budget`` runs alone, with nothing else
    encoded, when it comes first."""
    queues = [(seq, deque(g for g in seq.groups if g.patch_pages is not None)) for seq in seqs]
    taken: list[tuple[Sequence, Group]] = []
    used = 0
    seq_used: dict[str, int] = defaultdict(int)
    for limit in (max_share * budget, budget):
        for seq, queue in queues:
            while queue:
                group = queue[0]
                if used == 0 and group.num_patches > budget:
                    return [(seq, group)]  # too big for any step: it runs alone
                mine = seq_used[seq.req_id]
                over_share = mine > 0 and mine + group.num_patches > limit
                if used + group.num_patches > budget or over_share:
                    break  # keep prompt order within the sequence
                queue.popleft()
                taken.append((seq, group))
                used += group.num_patches
                seq_used[seq.req_id] = mine + group.num_patches
    return taken


def fill_prefill(seqs: Iterable[Sequence], encode: list[EncodeWork], budget: int,
                 max_share: float) -> list[PrefillWork]:
    """One chunk per admitted sequence that still prefills, in the given (arrival) order, of tokens whose embeddings
    are ready (the worker runs the step's ``encode`` first; ``Sequence.prefill_end``), ``budget`` tokens in all, each
    sequence first capped at ``max_share`` of it (at least one token), what is left then given out again without the
    cap."""
    encoding: dict[str, set[tuple[int, int]]] = defaultdict(set)
    for work in encode:
        encoding[work.req_id].add((work.item, work.index))
    demand = [(seq, seq.prefill_end(encoding.get(seq.req_id, ()))) for seq in seqs
              if seq.block_table is not None and not seq.prefill_done]
    ends = {seq.req_id: seq.num_computed_tokens for seq, _ in demand}
    used = 0
    for limit in (max(1, int(max_share * budget)), budget):
        for seq, ready_end in demand:
            start, end = seq.num_computed_tokens, ends[seq.req_id]
            n = min(ready_end - end, budget - used, limit - (end - start))
            if n > 0:
                ends[seq.req_id] = end + n
                used += n
    return [_chunk(seq, ends[seq.req_id]) for seq, _ in demand if ends[seq.req_id] > seq.num_computed_tokens]


def short_prefills(seqs: Iterable[Sequence], budget: int, short_tokens: int) -> list[PrefillWork]:
    """The short step's work: the admitted sequences, in the given (arrival) order, with nothing prefilled yet but
    their cached prefix, whose prompt ends within ``short_tokens`` tokens with every embedding ready (no group left to
    encode), each prefilled to its end, while ``budget`` tokens last. Empty when there are none (or ``short_tokens``
    is 0)."""
    works, used = [], 0
    for seq in seqs:
        left = seq.prompt_len - seq.num_computed_tokens
        if (seq.block_table is not None and seq.num_computed_tokens == seq.num_cached_tokens
                and 0 < left <= min(short_tokens, budget - used) and seq.ready_end() == seq.prompt_len):
            works.append(_chunk(seq, seq.prompt_len))
            used += left
    return works


def has_other_work(seqs: Iterable[Sequence], besides: set[str]) -> bool:
    """Whether a sequence not named in ``besides`` has a group ready to encode or prompt tokens ready to prefill."""
    return any(seq.req_id not in besides and (
        any(g.patch_pages is not None for g in seq.groups)
        or (seq.block_table is not None and seq.prefill_end() > seq.num_computed_tokens)) for seq in seqs)


def _chunk(seq: Sequence, end: int) -> PrefillWork:
    """The prefill of ``seq``'s prompt tokens from its computed ones up to ``end``."""
    return PrefillWork(seq.req_id, seq.num_computed_tokens, end, tuple(seq.block_table), end == seq.prompt_len)
