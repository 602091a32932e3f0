"""When a sequence stops (no torch: shared by the decode stage and the orchestrator)."""
from __future__ import annotations


def finish_reason(token_id: int, num_generated: int, max_tokens: int, min_tokens: int, ignore_eos: bool,
                  eos_ids: list[int] | tuple[int, ...]) -> str | None:
    """``"stop"`` (an EOS token once ``min_tokens`` are out, unless ``ignore_eos``), ``"length"``
    (``max_tokens`` reached) or None to go on. ``num_generated`` counts ``token_id`` itself.
    Same rule as vLLM's ``SamplingParams`` (min_tokens, ignore_eos, max_tokens).
    """
    if token_id in eos_ids and not ignore_eos and num_generated > min_tokens:
        return "stop"
    if num_generated >= max_tokens:
        return "length"
    return None
