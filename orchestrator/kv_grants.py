"""Which of the budget scheduler's sequences get KV pages, and how many (``orchestrator.scheduler``; docs/design.md,
"Scheduling"): admission in arrival order with backfill (``orchestrator.admission``), a sequence's cached prefix
shared (``orchestrator.prefix_cache``), and pages granted as decode writes them where the pool stays safe
(``orchestrator.kv_growth``). Pure Python, on the scheduler's own sequences."""
from __future__ import annotations

from typing import Iterable

from orchestrator.admission import Candidate, backfill
from orchestrator.kv_growth import Need, SafeState, plan
from orchestrator.prefix_cache import PrefixCache
from orchestrator.sequence import Sequence


class KVGrants:
    """The KV pages of a scheduler's sequences (``seqs``, in arrival order, and ``held``, those being removed: both
    the scheduler's, read here).

    A sequence is admitted with the pages of its prompt and of its next ``pages_ahead`` pages of tokens (at most its
    prompt + max_tokens), and granted more as decode writes them (`grow`: once fewer than a page's tokens are left
    ahead, up to `_ahead`), while the pool stays safe: every admitted
    sequence could still be granted pages up to its prompt + max_tokens, one after another.

    Args:
        kv: the replica's KV pages and prefix cache.
        page_size: tokens per KV page.
        pages_ahead: pages a sequence holds past its tokens (>= 1).
        seqs, held: the scheduler's.
    """

    def __init__(self, kv: PrefixCache, page_size: int, pages_ahead: int, seqs: dict[str, Sequence],
                 held: set[str]) -> None:
        self._kv, self._page_size, self._pages_ahead = kv, page_size, pages_ahead
        self._seqs, self._held = seqs, held
        self._hits: dict[str, tuple[int, list[int]]] = {}  # req_id -> (cache version, its cached pages then)
        self._short: set[str] = set()  # sequences in decode refused the pages they wanted last time
        self._deferred = 0  # pages (all but hashed prompt pages) removed sequences hold until the step in flight ends
        self._grants: dict[str, list[int]] = {}  # pages granted to them and not yet taken by `grow`

    @property
    def num_short(self) -> int:
        """Sequences in decode whose next token's KV has no page (refused the pages they want)."""
        return sum(self._seqs[r].prompt_len + self._seqs[r].num_generated > len(self._seqs[r].block_table)
                   * self._page_size for r in self._short)

    def pages_for(self, num_tokens: int) -> int:
        """KV pages that ``num_tokens`` tokens take."""
        return -(-num_tokens // self._page_size)

    def forget(self, req_id: str) -> None:
        """The sequence is being removed: its pages (those granted and not yet taken too) go back with its table."""
        self._hits.pop(req_id, None)
        self._short.discard(req_id)
        self._grants.pop(req_id, None)

    def defer(self, seq: Sequence) -> None:
        """``seq`` is removed while the step in flight writes its pages: they come back with `deferred_freed`, and
        count as returns meanwhile (the pool stays safe)."""
        self._deferred += self._private(seq, len(seq.block_table))

    def deferred_freed(self) -> None:
        """The step in flight has ended: the removed sequences' pages are back."""
        self._deferred = 0

    def grow(self, decoded: Iterable[str]) -> dict[str, list[int]]:
        """Counts one more token made by decode for each of ``decoded`` (its first: it has joined decode); returns the
        pages granted since the last call, per sequence. A sequence in decode with less than a page's tokens left
        ahead is granted pages (`_ahead`), where the pool stays safe (``kv_growth.plan``), else when pages come back
        (decode skips it once its next token has no page).

        Raises:
            KeyError: a sequence of ``decoded`` not held.
        """
        for req_id in decoded:
            self._seqs[req_id].num_generated += 1
        self._grow(decoded)
        grants, self._grants = self._grants, {}
        return grants

    def admit(self) -> list[Sequence]:
        """Grants the pages that sequences in decode want, then admits by the admission rule (`admission`):
        the sequences admitted, their block tables set, their cached prefix's tokens computed."""
        self._grow()
        admitted = []
        while granted := self.admission():  # one at a time: a grant may evict pages a later one would share
            seq = list(self._seqs.values())[granted[0]]
            hits = self._cached_pages(seq)
            cached = len(hits) * self._page_size
            seq.block_table = self._kv.grant(hits, self._ahead(seq) - len(hits),
                                             seq.prompt_len if seq.reads_cache else 0, cached)
            assert seq.block_table is not None, "admission granted what the pool has"
            self._hits.pop(seq.req_id, None)
            seq.num_cached_tokens = seq.num_computed_tokens = cached
            admitted.append(seq)
        return admitted

    def admission(self, new: Sequence | None = None) -> list[int]:
        """Arrival-order indices of the waiting sequences `admit` grants pages to now, in that order; with ``new``,
        it is imagined arriving after all others (index len(seqs)). A waiting sequence takes its first pages
        (`_ahead`) less the cached ones other sequences hold (``PrefixCache.cost``)."""
        seqs = [*self._seqs.values(), *([new] if new is not None else [])]
        if all(seq.block_table is not None or seq.req_id in self._held for seq in seqs):
            return []
        candidates = [
            Candidate(0, 0, None) if seq.block_table is None and seq.req_id in self._held else  # never admitted
            Candidate(0, self._worst(seq), None) if seq.block_table is not None else
            Candidate(self._kv.cost(self._ahead(seq), self._cached_pages(seq)), self._worst(seq),
                      self._need(seq, self._ahead(seq)))
            for seq in seqs]
        return backfill(candidates, self._kv.num_total, SafeState(self._kv.num_free, self._needs().values()))

    def _grow(self, decoded: Iterable[str] = ()) -> None:
        """Grants what the sequences that made a token (``decoded``) or were refused before want now."""
        wants = {req_id: self._ahead(seq) - len(seq.block_table) for req_id in self._short.union(decoded)
                 if req_id not in self._held and len((seq := self._seqs[req_id]).block_table) < self._due(seq)}
        if not wants:
            return
        granted = plan(self._kv.num_free, self._needs(), wants)
        for req_id, pages in granted.items():
            fresh = self._kv.grant([], pages, 0, 0)
            assert fresh is not None, "plan grants at most the free pages"
            self._seqs[req_id].block_table += fresh
            self._grants.setdefault(req_id, []).extend(fresh)
        self._short = {req_id for req_id in wants if len((seq := self._seqs[req_id]).block_table) < self._due(seq)}

    def _worst(self, seq: Sequence) -> int:
        return self.pages_for(seq.prompt_len + seq.max_tokens)

    def _ahead(self, seq: Sequence) -> int:
        """Pages a sequence is granted up to: its prompt's and its tokens made (its first, from prefill, before it has
        it) and ``pages_ahead`` pages more, or half its tokens made more where that is larger (at most 16 pages), so
        a long reply is granted pages less often (fewer messages to decode; at most a third of its pages unwritten);
        at most its prompt + max_tokens."""
        made = max(seq.num_generated, 1)
        ahead = max(self._pages_ahead * self._page_size, min(made // 2, 16 * self._page_size))
        return self.pages_for(seq.prompt_len + min(seq.max_tokens, made + ahead))

    def _due(self, seq: Sequence) -> int:
        """Pages below which a sequence in decode is granted more (`_ahead`): those of its tokens made and one page's
        tokens more, at most its prompt + max_tokens (decode may be a step ahead, and a grant takes a round trip)."""
        return self.pages_for(seq.prompt_len + min(seq.max_tokens, seq.num_generated + self._page_size))

    def _need(self, seq: Sequence, held: int) -> Need:
        """An admitted sequence's worst case holding ``held`` pages; it returns at least `_private` ones."""
        return Need(self._worst(seq) - held, self._private(seq, held))

    @staticmethod
    def _private(seq: Sequence, held: int) -> int:
        """Of ``held`` pages, those ``seq`` returns when it ends whatever other sequences do: all but its prompt's
        full pages, which the prefix cache may share (``block_hashes``, one each; none where it is off). (Counting
        the partial last prompt page and, without the prefix cache, the whole prompt, a short request is admitted
        beside a long reply whose worst case needs its pages back.)"""
        return held - len(seq.block_hashes)

    def _needs(self) -> dict[str, Need]:
        """Every sequence holding pages (one being removed: nothing more to grant, its pages back soon), and the
        pages of those removed that the step in flight still writes (key "")."""
        needs = {req_id: Need(0, self._private(seq, len(seq.block_table))) if req_id in self._held
                 else self._need(seq, len(seq.block_table))
                 for req_id, seq in self._seqs.items() if seq.block_table is not None}
        if self._deferred:
            needs[""] = Need(0, self._deferred)
        return needs

    def _cached_pages(self, seq: Sequence) -> list[int]:
        """The cached pages a waiting sequence would share now: the longest cached prefix of its prompt, short of
        its last token (whose logits prefill must compute), none where it does not read the cache (``reads_cache``);
        remembered until the cache changes. A media group the prefix ends in is encoded again (whole) for its tokens
        after it."""
        if not seq.reads_cache or not seq.block_hashes:
            return []
        known = self._hits.get(seq.req_id)
        if known is not None and known[0] == self._kv.version:
            return known[1]
        hits = self._kv.lookup(seq.block_hashes[:(seq.prompt_len - 1) // self._page_size])
        self._hits[seq.req_id] = (self._kv.version, hits)
        return hits
