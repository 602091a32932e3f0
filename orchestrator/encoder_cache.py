"""The encoder cache (issue 21, item 2): which vision-tower outputs the encode_prefill stage keeps, decided here.

The stage keeps a group's merged visual embeddings ([tokens, hidden], the model's dtype, on its GPU) under the key
its ``EncodeWork`` names, and drops the keys a ``StepPlan`` lists in ``evict``; it copies kept embeddings into a new
prompt's rows as its ``NewRequest.cached_embeds`` says. This mirror, pure Python in the orchestrator, decides all of
it: a key is a media item's identity (``orchestrator.media_identity``) and the group's index, so the same video or
image in another prompt (another position, another system prompt) skips flashcodec's decode and the vision tower
for its cached groups. Entries are bounded by ``capacity`` tokens (about hidden x 2 bytes a token on the GPU: 7 KB
for the 7B), evicted least recently used first; an entry a waiting or prefilling request will copy is pinned.
vLLM keeps encoder outputs the same way (its ``EncoderCacheManager``, by multimodal hash). Not thread-safe (the
orchestrator's one asyncio loop).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from orchestrator.sequence import Group, Sequence


def group_key(identity: bytes, index: int) -> bytes:
    """The cache key of group ``index`` of the media item named ``identity``."""
    return identity + index.to_bytes(4, "little")


@dataclass(frozen=True)
class EncoderCacheStats:
    """Counts since start, in visual tokens: ``queried_tokens`` (groups looked up as requests arrive),
    ``hit_tokens`` (found), ``evicted_tokens``; and now: ``tokens`` held by entries."""

    queried_tokens: int
    hit_tokens: int
    evicted_tokens: int
    tokens: int


class EncoderCache:
    """Args: capacity: visual tokens the stage may keep (0: no encoder cache).

    Raises:
        ValueError: a negative capacity.
    """

    def __init__(self, capacity: int = 0) -> None:
        if capacity < 0:
            raise ValueError(f"encoder_cache_tokens must be >= 0, got {capacity}")
        self.capacity = capacity
        self._tokens: OrderedDict[bytes, int] = OrderedDict()  # key -> tokens, least recently used first
        self._stored: set[bytes] = set()  # keys whose embeddings the stage holds (their encode step completed)
        self._pins: dict[bytes, int] = {}  # key -> requests that will copy it or are encoding it
        self._claimed: dict[str, list[bytes]] = {}  # req_id -> its pinned keys
        self._evicted: list[bytes] = []
        self._queried = self._hit = self._evicted_tokens = 0

    def claim(self, seq: Sequence) -> tuple[tuple[int, bytes], ...]:
        """A new sequence's groups found cached: each is marked encoded and cached (never decoded nor encoded) and
        pinned until `release`. Returns (token offset, key) per such group: its ``NewRequest.cached_embeds``."""
        found = []
        for group in seq.groups:
            if group.cache_key is None or self.capacity == 0:
                continue
            self._queried += group.num_tokens
            if group.cache_key in self._stored:
                self._hit += group.num_tokens
                self._tokens.move_to_end(group.cache_key)
                self._pin(seq.req_id, group.cache_key)
                group.encoded = group.cached = True
                found.append((group.token_offset, group.cache_key))
        return tuple(found)

    def reserve(self, req_id: str, group: Group) -> bytes | None:
        """Room for the embeddings of ``group``, about to be encoded: its key (the stage keeps them under it) or
        None (not kept: no key, already kept, or no room among unpinned entries)."""
        key = group.cache_key
        if key is None or key in self._tokens or group.num_tokens > self.capacity:
            return None
        evictable = sum(n for k, n in self._tokens.items() if k not in self._pins)
        if self.capacity - sum(self._tokens.values()) + evictable < group.num_tokens:
            return None
        while sum(self._tokens.values()) + group.num_tokens > self.capacity:
            victim = next(k for k in self._tokens if k not in self._pins)
            self._drop(victim)
        self._tokens[key] = group.num_tokens
        self._pin(req_id, key)  # until its step completes or fails
        return key

    def stored(self, keys: list[bytes]) -> None:
        """The step that encoded ``keys`` completed: the stage holds their embeddings."""
        self._stored.update(k for k in keys if k in self._tokens)

    def release(self, req_id: str) -> None:
        """``req_id`` has copied what it claimed (its prefill is done) or is gone: its pins end. A key it reserved
        whose step never completed is dropped."""
        for key in self._claimed.pop(req_id, ()):
            self._pins[key] -= 1
            if not self._pins[key]:
                del self._pins[key]
                if key not in self._stored and key in self._tokens:
                    self._drop(key)

    def take_evicted(self) -> tuple[bytes, ...]:
        """Keys the stage must drop (sent with the next plan)."""
        evicted, self._evicted = tuple(self._evicted), []
        return evicted

    def stats(self) -> EncoderCacheStats:
        return EncoderCacheStats(self._queried, self._hit, self._evicted_tokens, sum(self._tokens.values()))

    def _pin(self, req_id: str, key: bytes) -> None:
        self._pins[key] = self._pins.get(key, 0) + 1
        self._claimed.setdefault(req_id, []).append(key)

    def _drop(self, key: bytes) -> None:
        self._evicted_tokens += self._tokens.pop(key)
        self._stored.discard(key)
        self._evicted.append(key)
