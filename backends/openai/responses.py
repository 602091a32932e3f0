"""The orchestrator's responses -> OpenAI's bodies: a whole chat completion or completion, or its streamed chunks.

Each orchestrator response carries the text made since the last one (UTF-8, whole characters), its token ids when
asked for, and, on the last, ``finish_reason`` and the prompt's and the reply's token counts (``usage``).
"""
from __future__ import annotations

import time
import uuid

from backends.openai.logprobs import chat_logprobs, completion_logprobs
from backends.openai.schemas import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                                     ChatCompletionChunk, ChatLogprobs, Completion, CompletionChoice,
                                     CompletionLogprobs, Delta, PromptTokensDetails, Usage)
from client.api import ResponsePiece


def usage(piece: ResponsePiece) -> Usage | None:
    """The token counts of a request's last response (None on the others)."""
    if piece.num_input_tokens is None or piece.num_output_tokens is None:
        return None
    details = None if piece.num_cached_tokens is None else PromptTokensDetails(cached_tokens=piece.num_cached_tokens)
    return Usage(prompt_tokens=piece.num_input_tokens, completion_tokens=piece.num_output_tokens,
                 total_tokens=piece.num_input_tokens + piece.num_output_tokens, prompt_tokens_details=details)


class Reply:
    """A whole reply gathered from its responses: ``text``, ``token_ids``, ``finish_reason``, ``usage``,
    ``visual_cap`` (what max_visual_tokens lowered, or None), ``media`` (what was done with each image and video,
    or None without media), ``timeline`` (with ``return_timeline``, or None), ``logprobs`` (the orchestrator's
    entries, one per token, where asked)."""

    def __init__(self):
        self._text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[dict] = []
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.visual_cap: dict | None = None
        self.media: list[dict] | None = None
        self.timeline: dict | None = None

    def add(self, piece: ResponsePiece) -> None:
        self._text.append(piece.text.decode("utf-8", errors="replace"))
        self.token_ids += piece.token_ids
        self.logprobs += piece.logprobs or ()
        self.finish_reason = piece.finish_reason or self.finish_reason
        self.usage = usage(piece) or self.usage
        self.visual_cap = piece.visual_cap or self.visual_cap
        self.media = piece.media or self.media
        self.timeline = piece.timeline or self.timeline

    @property
    def text(self) -> str:
        return "".join(self._text)


class _Shape:
    """One request's bodies: its id, creation time (Unix seconds) and model name are the same in all of them."""

    prefix = ""

    def __init__(self, model: str, return_token_ids: bool, top_logprobs: int | None = None):
        """``top_logprobs``: the request's log probabilities (the top tokens' count; None: not asked)."""
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.return_token_ids = return_token_ids
        self.top_logprobs = top_logprobs
        self._first = True

    def _ids(self, token_ids) -> list[int] | None:
        return list(token_ids) if self.return_token_ids else None


class ChatShape(_Shape):
    """``chat.completion`` and ``chat.completion.chunk`` bodies; the first chunk carries the assistant's role."""

    prefix = "chatcmpl"

    def whole(self, reply: Reply) -> ChatCompletion:
        choice = ChatChoice(message=AssistantMessage(content=reply.text), logprobs=self._logprobs(reply.logprobs),
                            finish_reason=reply.finish_reason, token_ids=self._ids(reply.token_ids))
        return ChatCompletion(id=self.id, created=self.created, model=self.model, choices=[choice], usage=reply.usage,
                              visual_cap=reply.visual_cap, media=reply.media, timeline=reply.timeline)

    def chunk(self, piece: ResponsePiece) -> ChatCompletionChunk:
        delta = Delta(role="assistant" if self._first else None, content=piece.text.decode("utf-8", errors="replace"))
        self._first = False
        choice = ChatChunkChoice(delta=delta, logprobs=self._logprobs(piece.logprobs or []),
                                 finish_reason=piece.finish_reason, token_ids=self._ids(piece.token_ids))
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice],
                                   visual_cap=piece.visual_cap, media=piece.media, timeline=piece.timeline)

    def usage_chunk(self, counts: Usage) -> ChatCompletionChunk:
        """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=counts)

    def _logprobs(self, entries: list[dict]) -> ChatLogprobs | None:
        return None if self.top_logprobs is None else chat_logprobs(entries, self.top_logprobs)


class CompletionShape(_Shape):
    """``text_completion`` bodies, whole and streamed."""

    prefix = "cmpl"

    def __init__(self, model: str, return_token_ids: bool, top_logprobs: int | None = None):
        super().__init__(model, return_token_ids, top_logprobs)
        self._offset = 0  # the streamed text so far: where the next chunk's text starts (logprobs.text_offset)

    def whole(self, reply: Reply) -> Completion:
        choice = CompletionChoice(text=reply.text, logprobs=self._logprobs(reply.logprobs),
                                  finish_reason=reply.finish_reason, token_ids=self._ids(reply.token_ids))
        return Completion(id=self.id, created=self.created, model=self.model, choices=[choice], usage=reply.usage,
                          timeline=reply.timeline)

    def chunk(self, piece: ResponsePiece) -> Completion:
        text = piece.text.decode("utf-8", errors="replace")
        choice = CompletionChoice(text=text, logprobs=self._logprobs(piece.logprobs or []),
                                  finish_reason=piece.finish_reason, token_ids=self._ids(piece.token_ids))
        self._offset += len(text)  # each chunk's offsets start at its own text, as vLLM anchors them
        return Completion(id=self.id, created=self.created, model=self.model, choices=[choice], timeline=piece.timeline)

    def usage_chunk(self, counts: Usage) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=[], usage=counts)

    def _logprobs(self, entries: list[dict]) -> CompletionLogprobs | None:
        return None if self.top_logprobs is None else completion_logprobs(entries, self._offset)
