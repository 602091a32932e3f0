"""The KV pool of one replica with its prefix cache (issue 21; docs/design.md, "Prefix cache"): reference-counted
pages, full prompt pages kept by the hash of the prompt up to their end, and the cache's region of the pool.

A page is *held* while one or more sequences have it in their block table (its count of holders), *idle* when no
sequence holds it but it keeps the KV of a cached prefix, and *free* otherwise. Held pages are never evicted. Idle
pages form the cache's region: evicted least recently released first when the pool needs pages, kept at most
``ceiling`` pages; ``floor`` pages of the pool are never held, so that at least that many cached pages survive any
load. vLLM's KV cache manager (`vllm/v1/core/kv_cache_manager.py`) has the same three states, without the region's
bounds. Pure Python, not thread-safe (the orchestrator's one asyncio loop).
"""
from __future__ import annotations

import array
import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from orchestrator.pages import PageAllocator


def block_hashes(input_ids: Sequence[int], media: Iterable[tuple[int, int, bytes]], page_size: int
                 ) -> tuple[bytes, ...]:
    """One hash per full page of a prompt, each naming the prompt's tokens from its start to the page's end.

    Hash k chains hash k-1 with page k's token ids and the identity (``orchestrator.media_identity``) of every media
    item whose visual tokens fall in the page: visual tokens are one placeholder id, so the item's identity tells two
    videos apart, as vLLM's block hashes carry their multimodal hashes. A partial last page has no hash (never cached).

    Args:
        input_ids: the prompt's token ids, visual placeholders expanded (tokens).
        media: (first token, end token, identity) per media item, in prompt order.
        page_size: tokens per KV page.

    Returns:
        ``len(input_ids) // page_size`` 16-byte BLAKE2b digests.
    """
    spans = list(media)
    tokens = array.array("q", input_ids).tobytes()  # 8 bytes a token id
    hashes, parent = [], b""
    for page in range(len(input_ids) // page_size):
        start, end = page * page_size, (page + 1) * page_size
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(tokens[8 * start:8 * end])
        for first, last, identity in spans:
            if first < end and last > start:
                digest.update(b"|" + identity)
        parent = digest.digest()
        hashes.append(parent)
    return tuple(hashes)


@dataclass(frozen=True)
class CacheConfig:
    """The orchestrator's cache parameters: ``prefix_caching`` (on by default, as in vLLM), the cache's region as
    fractions of each replica's KV pool: ``prefix_cache_floor`` (kept from requests) and ``prefix_cache_ceiling``
    (most pages idle in the cache); ``encoder_cache_tokens``: visual tokens each replica's encoder cache keeps
    (``orchestrator.encoder_cache``; 0: none).

    Raises:
        ValueError: a fraction outside [0, 1) for the floor or [0, 1] for the ceiling, or a negative token count.
    """

    enabled: bool = True
    floor: float = 0.0
    ceiling: float = 1.0
    encoder_tokens: int = 16384

    def __post_init__(self) -> None:
        if not (0 <= self.floor < 1 and 0 <= self.ceiling <= 1):
            raise ValueError(f"prefix_cache_floor must be in [0, 1) and prefix_cache_ceiling in [0, 1], got "
                             f"{self.floor} and {self.ceiling}")
        if self.encoder_tokens < 0:
            raise ValueError(f"encoder_cache_tokens must be >= 0, got {self.encoder_tokens}")

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> "CacheConfig":
        switch = params.get("prefix_caching", "true").strip().lower()
        if switch not in ("true", "false"):
            raise ValueError(f"parameter prefix_caching must be true or false, got {params['prefix_caching']!r}")
        try:
            return cls(switch == "true", float(params.get("prefix_cache_floor") or 0.0),
                       float(params.get("prefix_cache_ceiling") or 1.0),
                       int(params.get("encoder_cache_tokens") or cls.encoder_tokens))
        except ValueError as exc:
            raise ValueError(f"parameters prefix_cache_floor / prefix_cache_ceiling / encoder_cache_tokens: "
                             f"{exc}") from None

    def pool(self, pages: PageAllocator) -> "PrefixCache":
        """``pages`` as a replica's `PrefixCache` with this region (its floor rounded down, ceiling up, in pages)."""
        return PrefixCache(pages, int(self.floor * pages.num_total), math.ceil(self.ceiling * pages.num_total))


@dataclass(frozen=True)
class CacheStats:
    """Counts since start (``queried_tokens``, ``hit_tokens``: prompt tokens of admitted sequences and those found
    cached; ``evictions``: pages) and now (``cached_pages``: pages with a hash, held or idle; ``idle_pages``)."""

    queried_tokens: int
    hit_tokens: int
    evictions: int
    cached_pages: int
    idle_pages: int


class PrefixCache:
    """A replica's KV pages as the scheduler grants them (``orchestrator.pages.PagePool`` plus ``grant``), with
    the prefix cache over them.

    Args:
        pages: the pool's free list (every page free).
        floor: pages of the pool kept from sequences (>= 0, below the pool's size).
        ceiling: most idle cached pages (>= 0; None: no bound but the pool).

    Raises:
        ValueError: a bound out of range.
    """

    def __init__(self, pages: PageAllocator, floor: int = 0, ceiling: int | None = None) -> None:
        if not 0 <= floor < pages.num_total or (ceiling is not None and ceiling < 0):
            raise ValueError(f"{pages.name}: cache floor {floor} must be in [0, {pages.num_total}) and ceiling "
                             f"{ceiling} >= 0")
        self._pages, self.floor, self.ceiling = pages, floor, ceiling
        self._holders: dict[int, int] = {}  # held page -> sequences holding it
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self._queried = self._hit = self._evictions = 0
        self.version = 0  # changes whenever a lookup could answer differently

    @property
    def num_total(self) -> int:
        """Pages sequences may hold at once: the pool less the floor (pages)."""
        return self._pages.num_total - self.floor

    @property
    def num_free(self) -> int:
        """Pages a sequence may still be granted: free ones and idle cached ones beyond the floor (pages)."""
        return max(0, self.num_total - len(self._holders))

    def lookup(self, hashes: Iterable[bytes]) -> list[int]:
        """The pages of the longest cached prefix of ``hashes`` (a prompt's `block_hashes`), in order."""
        found = []
        for h in hashes:
            page = self._by_hash.get(h)
            if page is None:
                break
            found.append(page)
        return found

    def cost(self, pages: int, hits: Iterable[int]) -> int:
        """Of `num_free`, what granting ``pages`` pages in all takes when ``hits`` (cached pages among them) are
        shared: hits that a sequence already holds cost nothing, idle ones leave the cache's region."""
        return pages - sum(1 for page in hits if page in self._holders)

    def grant(self, hits: list[int], new: int, prompt_tokens: int, hit_tokens: int) -> list[int] | None:
        """Holds the cached ``hits`` and ``new`` further pages for one sequence: its block table, or None (and
        nothing held) when `num_free` is short of ``cost(len(hits) + new, hits)``. Counts ``prompt_tokens`` queried
        and ``hit_tokens`` found (the hit rate)."""
        if self.cost(len(hits) + new, hits) > self.num_free:
            return None
        for page in hits:  # first, so that making room for the new pages cannot evict them
            self._idle.pop(page, None)
            self._holders[page] = self._holders.get(page, 0) + 1
        short = new - self._pages.num_free
        if short > 0:
            self._evict(short)
        fresh = self._pages.allocate(new)
        assert fresh is not None, "num_free promised the pages"
        self._holders.update(dict.fromkeys(fresh, 1))
        self._queried += prompt_tokens
        self._hit += hit_tokens
        return hits + fresh

    def register(self, page: int, block_hash: bytes) -> None:
        """Page ``page``, held and now holding the whole KV of the prefix named ``block_hash``, joins the cache.
        A hash already cached keeps its page (this one stays private and is freed as usual)."""
        assert page in self._holders, "only a held page is cached"
        if block_hash not in self._by_hash and page not in self._hash_of:
            self._by_hash[block_hash] = page
            self._hash_of[page] = block_hash
            self.version += 1

    def free(self, pages: Iterable[int]) -> None:
        """One sequence lets go of ``pages``: each is freed, or idle when cached and held by no other sequence. All of
        them or, on error, none.

        Raises:
            ValueError: a page not held (double free, unknown page, or listed twice).
        """
        pages = list(pages)
        if len(set(pages)) != len(pages) or any(page not in self._holders for page in pages):
            raise ValueError(f"{self._pages.name}: pages {pages} are not all held once (double free or unknown page)")
        released = []
        for page in reversed(pages):  # a block table's end first: idle, it is evicted before the prefix it extends
            self._holders[page] -= 1
            if self._holders[page] == 0:
                del self._holders[page]
                if page in self._hash_of:
                    self._idle[page] = None
                else:
                    released.append(page)
        self._pages.free(released)
        if self.ceiling is not None and len(self._idle) > self.ceiling:
            self._evict(len(self._idle) - self.ceiling)

    def stats(self) -> CacheStats:
        return CacheStats(self._queried, self._hit, self._evictions, len(self._hash_of), len(self._idle))

    def _evict(self, n: int) -> None:
        """Frees the ``n`` least recently released idle pages (their prefixes are no longer cached)."""
        victims = [self._idle.popitem(last=False)[0] for _ in range(n)]
        for page in victims:
            del self._by_hash[self._hash_of.pop(page)]
        self._pages.free(victims)
        self._evictions += n
        self.version += 1
