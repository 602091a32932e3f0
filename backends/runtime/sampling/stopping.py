"""When a sequence stops (no torch: shared by the decode and encode_prefill stages)."""
from __future__ import annotations

from backends.ipc.protocol import SamplingParams


def finish_reason(token_id: int, num_generated: int, max_tokens: int, sampling: SamplingParams,
                  eos_ids: list[int] | tuple[int, ...]) -> str | None:
    """``"stop"`` (once ``sampling.min_tokens`` are out: an eos token unless ``ignore_eos``, or one of
    ``stop_token_ids``), ``"length"`` (``max_tokens`` reached) or None to go on. ``num_generated`` counts
    ``token_id`` itself. Same rule as vLLM's ``check_stop`` (``vllm/v1/core/sched/utils.py``: min_tokens,
    ignore_eos, stop_token_ids, max_tokens).
    """
    if num_generated > sampling.min_tokens and (
            (token_id in eos_ids and not sampling.ignore_eos) or token_id in sampling.stop_token_ids):
        return "stop"
    if num_generated >= max_tokens:
        return "length"
    return None
