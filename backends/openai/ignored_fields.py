"""A request's top-level fields that this server ignores. Those of vLLM's that change nothing in a reply here
(:data:`KNOWN_IGNORED`, docs/openai.md) pass quietly, as vLLM declares them; any other is named in the API's log, once
a request, as vLLM's server warns of fields it does not know: a misspelt field, or another server's, shows there."""
from __future__ import annotations

import logging
from typing import Container, Iterable

log = logging.getLogger(__name__)

KNOWN_IGNORED = frozenset({
    "length_penalty", "truncation_side", "add_special_tokens", "spaces_between_special_tokens", "documents",
    "reasoning_effort", "include_reasoning", "thinking_token_budget", "session_id", "stream_interval",
    "kv_transfer_params", "vllm_xargs", "user", "cache_salt"})


def log_unknown(schema: str, sent: Iterable, fields: Container[str]) -> None:
    """Log the keys of ``sent`` (a request body's) that are neither ``fields`` (``schema``'s) nor
    :data:`KNOWN_IGNORED`, at most 500 characters of them."""
    unknown = sorted(str(key) for key in sent if key not in fields and key not in KNOWN_IGNORED)
    if unknown:
        log.warning("%s: fields ignored (unknown to this server): %s", schema, ", ".join(unknown)[:500])
