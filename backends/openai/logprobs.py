"""The orchestrator's ``logprobs`` entries -> OpenAI's ``logprobs`` objects (chat and completions).

An entry is one output token's, as the orchestrator sends it (the vLLM backend's ``logprobs`` output,
docs/requests.md): ``{"<token id>": {"logprob", "rank", "decoded_token"}}``, the sampled token first, then the most
likely tokens ranked 1, 2, ... (the sampled token, where it is one of them, once, with its own rank); its log
probabilities are finite, at least ``orchestrator.output_processor.MIN_LOGPROB`` (vLLM's floor). A prompt's entries
(``prompt_logprobs``) are alike, its first token's ``logprob`` and ``rank`` null.
"""
from __future__ import annotations

from backends.openai.response_schemas import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob


def chat_logprobs(entries: list[dict], top: int) -> ChatLogprobs:
    """Chat's ``logprobs``: per token its text, log probability and UTF-8 bytes, and the ``top`` most likely
    tokens' (by rank; the sampled token among them where it is one)."""
    content = []
    for entry in entries:
        figures = list(entry.values())
        ranked = sorted(figures, key=lambda f: f["rank"])[:top]
        content.append(TokenLogprob(**_top_logprob(figures[0]).model_dump(),
                                    top_logprobs=[_top_logprob(f) for f in ranked]))
    return ChatLogprobs(content=content)


def completion_logprobs(entries: list[dict], offset: int, top: int) -> CompletionLogprobs:
    """Completions' ``logprobs`` for the tokens of ``entries``: ``text_offset`` runs on from ``offset`` (where the
    first token's text starts in the choice's text: a streamed chunk's, the text before it) by each token's own
    text, as vLLM counts it (a token's text alone can differ from its share of the reply: a character split over
    tokens, a stop string cut off, so a whole reply's offsets are approximate past such a token). ``top_logprobs``
    maps the texts of each entry's token and of its ``top`` most likely tokens to their log probabilities, as vLLM
    does; an echoed prompt's first token (its log probability null) has null for both."""
    out = CompletionLogprobs()
    for entry in entries:
        token = next(iter(entry.values()))
        out.text_offset.append(offset)
        offset += len(token["decoded_token"])
        out.tokens.append(token["decoded_token"])
        out.token_logprobs.append(token["logprob"])
        ranked = sorted(entry.values(), key=lambda f: f["rank"] or 0)[:top]
        out.top_logprobs.append(None if token["logprob"] is None else
                                {f["decoded_token"]: f["logprob"] for f in [token, *ranked]})
    return out


def prompt_logprobs(entries: list[dict] | None) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs`` of a reply from the orchestrator's entries of its prompt: None for the first token
    (it follows nothing), each later one's entry as it is; None where there are none."""
    if entries is None:
        return None
    return [None if next(iter(entry.values()))["logprob"] is None else entry for entry in entries]


def _top_logprob(figures: dict) -> TopLogprob:
    token = figures["decoded_token"]
    return TopLogprob(token=token, logprob=figures["logprob"], bytes=list(token.encode("utf-8")))
