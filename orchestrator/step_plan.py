"""The step plan: what the orchestrator's scheduler hands the encode_prefill worker for one step.

Plain frozen dataclasses (vLLM v1's SchedulerOutput idea): the worker executes them and decides nothing.
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EncodeWork:
    """Run the vision encoder on group (item, index) of `req_id`, whole: `num_patches` patches (before
    the 2x2 merge), stored in order over `patch_pages` of the patch pool."""

    req_id: str
    item: int
    index: int
    patch_pages: tuple[int, ...]
    num_patches: int


@dataclass(frozen=True)
class PrefillWork:
    """Prefill prompt tokens [start, end) of a request, writing their KV into `block_table`'s pages.

    `is_last`: the chunk ends the prompt, so the worker samples the first output token.
    """

    req_id: str
    start: int
    end: int
    block_table: tuple[int, ...]
    is_last: bool


@dataclass(frozen=True)
class StepPlan:
    """One step: the worker runs all of `encode`, then all of `prefill`.

    `num_encode_patches` and `num_prefill_tokens` are the totals (patches, tokens).
    """

    encode: tuple[EncodeWork, ...]
    prefill: tuple[PrefillWork, ...]
    num_encode_patches: int = field(init=False)
    num_prefill_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_encode_patches", sum(w.num_patches for w in self.encode))
        object.__setattr__(self, "num_prefill_tokens", sum(w.end - w.start for w in self.prefill))
