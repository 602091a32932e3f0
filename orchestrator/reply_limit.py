"""The most tokens a reply may have (its ``max_tokens``) once the prompt is built.

A request's ``max_tokens`` is kept as sent. Sent as null (``RequestParams.max_tokens`` None; the OpenAI API's chat
request without ``max_tokens`` or ``max_completion_tokens``), the reply may run to the end of the context, as vLLM's
``SamplingParams`` reads None (its OpenAI server gives a chat request ``max_model_len`` minus the prompt), but at most
the orchestrator's ``default_max_tokens``: pages are granted as a reply grows, but the pool keeps room for every
running reply's prompt + ``max_tokens`` (``orchestrator.kv_growth``), so replies that may each fill the context would
be admitted fewer at a time. Nor more than the largest KV pool holds beside the prompt.
"""
from __future__ import annotations

from orchestrator.sampling_params import InvalidInput

DEFAULT_MAX_TOKENS = 4096


def reply_limit(max_tokens: int | None, min_tokens: int, prompt_tokens: int, *, default_max_tokens: int,
                max_model_len: int, pool_tokens: int) -> int:
    """The reply's ``max_tokens`` (tokens, >= 1).

    Args:
        max_tokens: the request's (tokens), or None: the rest of the context, at most ``default_max_tokens``.
        min_tokens: the request's (tokens); checked against a limit this function chose.
        prompt_tokens: the prompt's tokens, text and visual.
        default_max_tokens: the orchestrator's parameter (tokens, >= 1).
        max_model_len: prompt + output tokens per request.
        pool_tokens: tokens the largest KV pool holds (pages x page size).

    Returns ``max_tokens`` as sent, else the smallest of the three limits; 1 where the prompt leaves no room, for
    ``Prompt.check_length`` and the pool check to refuse naming the prompt.

    Raises:
        InvalidInput: ``max_tokens`` None and ``min_tokens`` above the limit chosen (named).
    """
    if max_tokens is not None:
        return max_tokens
    limits = {f"the server's default_max_tokens {default_max_tokens}": default_max_tokens,
              f"the rest of max_model_len {max_model_len} after the prompt's {prompt_tokens} tokens":
                  max_model_len - prompt_tokens,
              f"what the largest KV pool ({pool_tokens} tokens) holds beside the prompt's {prompt_tokens} tokens":
                  pool_tokens - prompt_tokens}
    why, limit = min(limits.items(), key=lambda item: item[1])
    if limit < 1:
        return 1
    if min_tokens > limit:
        raise InvalidInput(f"sampling_parameters: min_tokens {min_tokens} is more than this reply may have without "
                           f"max_tokens: {limit} tokens, {why}; send max_tokens")
    return limit
