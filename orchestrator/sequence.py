"""Per-request state that the scheduler keeps until the request finishes, fails or is cancelled.

vLLM v1 style: there is no prefill or decode mode; `num_computed_tokens` catches up with `prompt_len`.
"""

from collections.abc import Container
from dataclasses import dataclass, field

from backends.ipc.protocol import NewRequest

# A prompt's few text tokens before media still being decoded (a chat template's start, a short question) wait for
# that media instead of taking a step of their own: 16 one-image requests at once on the H200 prefilled their 39-token
# stubs in one eager step of 59.5 ms while their images became ready
# (bench/results/peer/seventh-run-2026-12-03/README.md).
STUB_TOKENS = 128


@dataclass
class Group:
    """One temporal-patch group of a media item (two video frames or one image); never split.

    Attributes:
        item: index of the media item in the request.
        index: index of the group in its item.
        token_offset: index in the prompt of the group's first visual token.
        num_tokens: the group's LLM tokens (after the 2x2 merge).
        num_patches: the group's vision-encoder input patches (before the merge).
        patch_pages: patch-pool pages holding the patches: None until the media stage reports them
            ready, and None again once the group is encoded (its pages are then returned).
        encoded: the encoder has run on the group; its embeddings wait in the encode_prefill worker
            until prefill covers its tokens.
        cache_key: the group's name in the encoder cache (``orchestrator.encoder_cache.group_key``; None: not
            cached there).
        cached: the group is never decoded nor encoded: its embeddings come from the encoder cache, or its tokens
            lie in the prompt's cached prefix (``encoded`` is set too).
    """

    item: int
    index: int
    token_offset: int
    num_tokens: int
    num_patches: int
    patch_pages: list[int] | None = None
    encoded: bool = False
    cache_key: bytes | None = None
    cached: bool = False

    @property
    def key(self) -> tuple[int, int]:
        """(item, index): the group's name within its request."""
        return (self.item, self.index)

    @property
    def token_end(self) -> int:
        """Index in the prompt just past the group's last visual token."""
        return self.token_offset + self.num_tokens


@dataclass
class Sequence:
    """One request's prompt as the scheduler sees it.

    Attributes:
        req_id: unique among the sequences a scheduler knows.
        prompt_len: prompt tokens, visual tokens included (>= 1).
        max_tokens: most tokens to generate (>= 1): the sequence's worst case, which the pool keeps room for
            (``orchestrator.kv_growth``); its pages are granted as decode writes them.
        groups: the media groups in prompt order (non-overlapping token ranges inside the prompt).
        num_computed_tokens: prompt tokens already prefilled (their KV written).
        block_table: KV pages granted (at admission, then as decode writes them); None while waiting.
        request: what the encode_prefill stage needs to know of the request, sent with the first step
            that has work for it (None: nothing, as in the scheduler's own tests).
        block_hashes: one per full page of the prompt (``orchestrator.prefix_cache.block_hashes``; empty: the
            prompt is neither looked up in the prefix cache nor cached).
        num_cached_tokens: prompt tokens found in the prefix cache at admission (a multiple of the page size),
            computed without a step.
        num_generated: tokens made so far, the first (from prefill) included, as decode reported them.
        reads_cache: whether the prompt is looked up in the prefix cache (False: every position is computed, for its
            prompt's log probabilities; its pages are cached all the same, as vLLM v1's
            ``skip_reading_prefix_cache``).

    Raises:
        ValueError: inconsistent sizes or group layout.
    """

    req_id: str
    prompt_len: int
    max_tokens: int
    groups: list[Group] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] | None = None
    request: NewRequest | None = None
    block_hashes: tuple[bytes, ...] = ()
    num_cached_tokens: int = 0
    reads_cache: bool = True
    num_generated: int = 0

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.max_tokens < 1:
            raise ValueError(f"{self.req_id}: prompt_len and max_tokens must be >= 1, "
                             f"got {self.prompt_len} and {self.max_tokens}")
        if not 0 <= self.num_computed_tokens <= self.prompt_len:
            raise ValueError(f"{self.req_id}: num_computed_tokens {self.num_computed_tokens} outside the prompt")
        end = 0
        for group in self.groups:
            if group.num_tokens < 1 or group.num_patches < 1:
                raise ValueError(f"{self.req_id}: group {group.key} has no tokens or no patches")
            if group.token_offset < end or group.token_end > self.prompt_len:
                raise ValueError(f"{self.req_id}: group {group.key} at tokens [{group.token_offset}, "
                                 f"{group.token_end}) overlaps its predecessor or leaves the prompt "
                                 f"({self.prompt_len} tokens)")
            end = group.token_end
        if len({group.key for group in self.groups}) != len(self.groups):
            raise ValueError(f"{self.req_id}: two groups share an (item, index)")

    @property
    def patches_left(self) -> int:
        """Patches of the groups not yet encoded (what a budget policy weighs: ``orchestrator.budget_policy``)."""
        return sum(g.num_patches for g in self.groups if not g.encoded)

    @property
    def prefill_done(self) -> bool:
        """Every prompt token has its KV written."""
        return self.num_computed_tokens == self.prompt_len

    def in_cached_prefix(self, group: Group) -> bool:
        """The group's tokens are all in the prefix found cached at admission (it is never encoded)."""
        return group.token_end <= self.num_cached_tokens

    def group(self, item: int, index: int) -> Group:
        """The group named (item, index).

        Raises:
            KeyError: no such group.
        """
        for group in self.groups:
            if group.key == (item, index):
                return group
        raise KeyError(f"{self.req_id}: no media group (item={item}, index={index})")

    def ready_end(self, encoding: Container[tuple[int, int]] = ()) -> int:
        """End (exclusive, tokens) of the prompt prefix whose embeddings are ready for prefill.

        Text tokens are always ready; a group's visual tokens are ready once it is encoded or is in
        `encoding` (the (item, index) keys encoded earlier in the same step).
        """
        for group in self.groups:
            if group.token_end <= self.num_computed_tokens:
                continue
            if not group.encoded and group.key not in encoding:
                # the tokens of an unencoded group before num_computed_tokens can only have come from the cache
                assert group.token_offset >= self.num_computed_tokens or self.num_computed_tokens == \
                    self.num_cached_tokens, "prefilled a token of an unencoded group"
                return max(group.token_offset, self.num_computed_tokens)
        return self.prompt_len

    def prefill_end(self, encoding: Container[tuple[int, int]] = ()) -> int:
        """End (exclusive, tokens) of what a step may prefill now: :meth:`ready_end`, except that a text stub (at most
        :data:`STUB_TOKENS` ready tokens, none of them visual) that stops before a group still being decoded (no
        patch pages yet) waits to go with that group's tokens (the end is then ``num_computed_tokens``): a prompt's
        leading text, text between groups, or the rest of longer text already partly prefilled."""
        start, end = self.num_computed_tokens, self.ready_end(encoding)
        text_only = not any(g.token_end > start and g.token_offset < end for g in self.groups)
        if 0 < end - start <= STUB_TOKENS and text_only and any(
                g.token_offset == end and g.patch_pages is None and not g.encoded for g in self.groups):
            return start
        return end
